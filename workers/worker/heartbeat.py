"""The Redis worker's heartbeat: its place in the heartbeat set (how gateways and `streamer up` find
live workers without scanning keys, clients/heartbeats.py), its stats key, cancel markers of running
jobs, and the idle time of the entries it holds kept fresh so no other worker reclaims them while
this one is alive.
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
from clients.heartbeats import STALE_MS
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

# One round trip per beat, timed by the Redis server's clock (readers compare against the same clock).
# KEYS[1] = stats hash, KEYS[2] = heartbeat set, KEYS[3..] = cancel markers of the running jobs.
# ARGV[1] = consumer, ARGV[2] = stats TTL (ms), ARGV[3] = STALE_MS, ARGV[4..] = stats field, value, ...
# Adds/updates our member, prunes members that stopped beating, returns EXISTS of each marker.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - tonumber(ARGV[3])))
local marked = {}
for i = 3, #KEYS do
  marked[#marked + 1] = redis.call('EXISTS', KEYS[i])
end
return marked
"""


class Heartbeat:
    """Every `heartbeat_s`: stats, cancel markers of running jobs (passed to `cancels`), entry freshness."""

    def __init__(self, redis: Redis, config: WorkerConfig, engine: Engine, state: WorkerState,
                 writer: EventWriter, cancels: CancelListener) -> None:
        self.redis, self.cfg, self.names, self.engine = redis, config, config.names, engine
        self.state, self.writer, self.cancels = state, writer, cancels
        # Registering only computes the script's hash (no Redis call): it is loaded on first use.
        self._refresh_own = redis.register_script(_REFRESH_OWN)
        self._beat = redis.register_script(_BEAT)

    async def loop(self) -> None:
        backoff = Backoff("heartbeat", log)
        key = self.names.worker(self.cfg.consumer)
        # Readers count a worker as alive for STALE_MS after its last beat: beat at least 3 times in it.
        period = min(self.cfg.heartbeat_s, STALE_MS / 3000)
        ttl_ms = int(period * 3000)
        try:
            while True:
                try:
                    await self._heartbeat(key, ttl_ms)
                    backoff.reset()
                except TRANSIENT as e:
                    await backoff.sleep(e)
                    continue
                except ResponseError as e:  # e.g. NOGROUP after Redis lost its data: the reader recreates it
                    log.warning("heartbeat: %s", e)
                await anyio.sleep(period)
        finally:  # stopped (the worker is leaving): no longer listed as alive
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self.leave()

    async def leave(self) -> None:
        """Take this worker out of the heartbeat set and drop its stats key (best effort: if Redis is
        unreachable now, the member is pruned STALE_MS after its last beat and the key expires)."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(self.names.heartbeats, self.cfg.consumer)
                pipe.delete(self.names.worker(self.cfg.consumer))
                await pipe.execute()
        except (*TRANSIENT, ResponseError) as e:
            log.warning("worker %s: could not leave the heartbeat set (%s)", self.cfg.consumer, e)

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {"model": self.cfg.model_name, "served_model_name": self.cfg.served_model_name or self.cfg.model_name,
                "consumer": self.cfg.consumer, "pid": os.getpid(), "device": s.get("device", ""),
                "dtype": s.get("dtype", ""),
                "running": s.get("num_running", 0), "waiting": s.get("num_waiting", 0),
                # kv_usage: the share of the cache's blocks in use (vLLM's kv_cache_usage_perc);
                # kv_block_fill: how full those blocks are (the last block of a sequence is partly empty).
                "kv_usage": _share(s.get("kv_blocks_used", 0), s.get("kv_blocks_total", 0)),
                "kv_block_fill": s.get("kv_utilization", 0.0), "kv_blocks_used": s.get("kv_blocks_used", 0),
                "kv_blocks_total": s.get("kv_blocks_total", 0), "max_model_len": s.get("max_model_len", 0),
                "jobs": self.state.held, "max_num_seqs": s.get("max_num_seqs", 0),
                # Stopping (SIGTERM): it reads no more jobs, so none is forwarded to it (affinity.py).
                "draining": int(self.state.stopping),
                "generation_tokens": s.get("generation_tokens", 0),
                # LoRA adapters in the engine's slots: routers prefer a worker that has a job's adapter.
                "loras": ",".join(s.get("loras") or ()),
                "writer_round_trips": self.writer.round_trips, "updated_ms": int(time.time() * 1000)}

    async def _heartbeat(self, key: str, ttl_ms: int) -> None:
        entries, running = list(self.state.pending_entries), list(self.state.running)
        stats = [str(x) for item in self.stats().items() for x in item]
        # Cancel markers catch cancels published while pub/sub was down.
        markers = [self.names.cancelled(request_id) for request_id in running]
        apart = self.names.cluster  # on a cluster each marker is in its request's slot
        replies = await self._beat(keys=[key, self.names.heartbeats, *([] if apart else markers)],
                                   args=[self.cfg.consumer, ttl_ms, STALE_MS, *stats])
        if apart and markers:
            async with self.redis.pipeline(transaction=False) as pipe:
                for marker in markers:
                    pipe.exists(marker)
                replies = await pipe.execute()
        for request_id, marked in zip(running, replies, strict=True):
            if marked:
                self.cancels.cancel(request_id)
        if not entries:
            return
        # Reset the idle time of our entries so no other worker reclaims them.
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in entries:
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            lost = await self._refresh_own(keys=[stream], args=[self.names.group, self.cfg.consumer, *ids])
            for entry_id in map(as_str, lost):
                self._lost(stream, entry_id)

    def _lost(self, stream: str, entry_id: str) -> None:
        request_id = self.state.release_entry(stream, entry_id)
        run = self.state.running.get(request_id or "")
        if run is not None and run.entry_id == entry_id:
            log.warning("request %s: taken over by another worker, stopping here", request_id)
            run.scope.cancel()


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
