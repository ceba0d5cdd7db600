"""The Redis worker's heartbeat: its stats key, cancel markers of running jobs, and the idle time of
the entries it holds kept fresh so no other worker reclaims them while this one is alive.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from clients.backoff import TRANSIENT, Backoff
from workers.worker.cancel import CancelListener
from workers.worker.config import WorkerConfig
from workers.worker.engine import Engine
from workers.worker.event_writer import EventWriter
from workers.worker.state import WorkerState, as_str

log = logging.getLogger("streamer.worker")

# Refresh the idle time of our own pending entries, but only those still ours: an entry another
# worker has taken over (we were presumed dead) must not be stolen back. Returns the ids we lost.
_REFRESH_OWN = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


class Heartbeat:
    """Every `heartbeat_s`: stats, cancel markers of running jobs (passed to `cancels`), entry freshness."""

    def __init__(self, redis: Redis, config: WorkerConfig, engine: Engine, state: WorkerState,
                 writer: EventWriter, cancels: CancelListener) -> None:
        self.redis, self.cfg, self.names, self.engine = redis, config, config.names, engine
        self.state, self.writer, self.cancels = state, writer, cancels
        # Registering only computes the script's hash (no Redis call): it is loaded on first use.
        self._refresh_own = redis.register_script(_REFRESH_OWN)

    async def loop(self) -> None:
        backoff = Backoff("heartbeat", log)
        key = self.names.worker(self.cfg.consumer)
        ttl_ms = int(self.cfg.heartbeat_s * 3000)
        while True:
            try:
                await self._heartbeat(key, ttl_ms)
                backoff.reset()
            except TRANSIENT as e:
                await backoff.sleep(e)
                continue
            except ResponseError as e:  # e.g. NOGROUP after Redis lost its data: the reader recreates it
                log.warning("heartbeat: %s", e)
            await anyio.sleep(self.cfg.heartbeat_s)

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {"model": self.cfg.model_name, "consumer": self.cfg.consumer, "pid": os.getpid(),
                "running": s.get("num_running", 0), "waiting": s.get("num_waiting", 0),
                "kv_usage": s.get("kv_utilization", 0.0), "kv_blocks_used": s.get("kv_blocks_used", 0),
                "kv_blocks_total": s.get("kv_blocks_total", 0), "jobs": self.state.held,
                "writer_round_trips": self.writer.round_trips, "updated_ms": int(time.time() * 1000)}

    async def _heartbeat(self, key: str, ttl_ms: int) -> None:
        entries, running = list(self.state.pending_entries), list(self.state.running)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={k: str(v) for k, v in self.stats().items()})
            pipe.pexpire(key, ttl_ms)
            for request_id in running:  # cancel markers catch cancels published while pub/sub was down
                pipe.exists(self.names.cancelled(request_id))
            replies = await pipe.execute()
        for request_id, marked in zip(running, replies[2:], strict=True):
            if marked:
                self.cancels.cancel(request_id)
        if not entries:
            return
        # Reset the idle time of our entries so no other worker reclaims them.
        lost = await self._refresh_own(keys=[self.names.requests],
                                       args=[self.names.group, self.cfg.consumer, *entries])
        for entry_id in map(as_str, lost):
            request_id = self.state.release_entry(entry_id)
            run = self.state.running.get(request_id or "")
            if run is not None and run.entry_id == entry_id:
                log.warning("request %s: taken over by another worker, stopping here", request_id)
                run.scope.cancel()
