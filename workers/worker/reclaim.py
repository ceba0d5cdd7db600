"""Reclaiming the entries of dead workers: an entry nobody refreshed for `claim_idle_s` is taken over
and goes through intake again, which resumes it from its event stream (clients/resume.py). The
consumers such workers leave in the group are deleted once they hold nothing and have been idle for
`consumer_idle_s`, so the group does not grow with every crash or restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from clients.backoff import TRANSIENT, Backoff
from clients.heartbeats import as_names, live_args, live_script
from clients.streams import all_streams, worker_stream_owners
from workers.worker.config import WorkerConfig
from workers.worker.intake import Intake
from workers.worker.state import WorkerState, as_str
from workers.worker.streams import Taken

log = logging.getLogger("streamer.worker")

# Delete the group's consumers that hold no pending entry, have been idle (no read, no claim) longer
# than ARGV[2] ms and are not among the live workers (ARGV[3..], read from the heartbeat set just
# before: on a cluster the set and a request stream may sit in different slots): crashed workers.
# Atomic on the stream, so a consumer cannot be handed an entry between the check and the delete
# (deleting a consumer drops its pending entries); a worker that started beating since the live list
# was read has not been idle that long. KEYS[1] = a request stream; ARGV[1] = group, ARGV[2] = idle
# bound (ms). Returns the names deleted.
_DROP_IDLE_CONSUMERS = """
local live = {}
for i = 3, #ARGV do
  live[ARGV[i]] = true
end
local removed = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #c, 2 do
    info[c[i]] = c[i + 1]
  end
  if info['pending'] == 0 and info['idle'] > tonumber(ARGV[2]) and not live[info['name']] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    removed[#removed + 1] = info['name']
  end
end
return removed
"""


class Reclaimer:
    """Takes over entries of dead workers and hands them to `Intake` like freshly read ones;
    `on_reclaim(stream)` is called for each entry taken over (metrics)."""

    def __init__(self, redis: Redis, config: WorkerConfig, state: WorkerState, intake: Intake,
                 on_reclaim: Callable[[str], None] = lambda stream: None) -> None:
        self.redis, self.cfg, self.names = redis, config, config.names
        self.state, self.intake = state, intake
        self.on_reclaim = on_reclaim
        self._drop_idle = redis.register_script(_DROP_IDLE_CONSUMERS)
        self._live = live_script(redis)
        self._next_cleanup = 0.0  # monotonic time of the next look for idle consumers
        self._woken = anyio.Event()

    def wake(self) -> None:
        """Look now, not at the next period: a draining worker handed jobs back (handoff.py)."""
        self._woken.set()

    async def claim_loop(self, jobs: TaskGroup) -> None:
        """Take over entries whose worker stopped refreshing them (dead), oldest first."""
        backoff = Backoff("reclaim", log)
        idle_ms = int(self.cfg.claim_idle_s * 1000)
        while True:
            with anyio.move_on_after(self.cfg.claim_idle_s / 2):
                await self._woken.wait()
            self._woken = anyio.Event()
            try:
                streams = self.intake.streams
                await streams.refresh()
                others = await worker_stream_owners(self.redis, self.names)
                others.pop(self.cfg.consumer, None)
                for stream in [*streams.names_read, *map(self.names.worker_requests, others)]:
                    await self._claim_stream(stream, idle_ms, jobs)
                await self._adopt(others, jobs)
                if time.monotonic() >= self._next_cleanup:
                    self._next_cleanup = time.monotonic() + self.cfg.consumer_idle_s / 4
                    await self.drop_idle_consumers()
                backoff.reset()
            except ResponseError as e:
                await self.intake.refused("reclaim", e, backoff)
            except TRANSIENT as e:
                await backoff.sleep(e)

    async def _claim_stream(self, stream: str, idle_ms: int, jobs: TaskGroup) -> None:
        cursor = "0-0"
        while (count := self.state.capacity()) > 0:
            try:
                cursor, entries, *_ = await self.redis.xautoclaim(stream, self.names.group, self.cfg.consumer,
                                                                  idle_ms, start_id=cursor, count=count)
            except ResponseError as e:
                # Another worker's stream that is gone: nothing to claim there, and raising would stop
                # this pass before the other workers' streams and `_adopt` (which removes a dead one's).
                if _gone(e) and stream not in self.intake.streams.names_read:
                    return
                raise
            if entries:
                await self._start_reclaimed(stream, entries, jobs)
            if cursor in (b"0-0", "0-0"):
                return

    async def _adopt(self, others: dict[str, int], jobs: TaskGroup) -> None:
        """Jobs routed to another worker that is dead (no fresh heartbeat) or has left them unread for
        `claim_idle_s` (stalled) are taken here; a dead worker's emptied stream is removed once it has
        been gone for `consumer_idle_s`."""
        if not others:
            return
        live = set(as_names(await self._live(**live_args(self.names))))
        seconds, micros = await self.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        for name, beat_ms in others.items():
            stream = self.names.worker_requests(name)
            if name in live and not await self._stalled(stream, now_ms):
                continue
            entries = await self._take_from(stream)
            if entries:
                log.info("took %d job(s) routed to %s worker %s", len(entries),
                         "stalled" if name in live else "dead", name)
                await self.intake.start_batch(entries, jobs)
            elif name not in live and now_ms - beat_ms > self.cfg.consumer_idle_s * 1000:
                await self._remove_stream(name, stream)

    async def _stalled(self, stream: str, now_ms: int) -> bool:
        """Its oldest entry nobody read yet waits for longer than claim_idle_s."""
        group = await self._group(stream)
        if group is None or not group.get("lag"):
            return False
        first = await self.redis.xrange(stream, f"({as_str(group['last-delivered-id'])}", "+", count=1)
        return bool(first) and now_ms - int(as_str(first[0][0]).split("-")[0]) > self.cfg.claim_idle_s * 1000

    async def _group(self, stream: str) -> dict[str, Any] | None:
        """Our group's XINFO GROUPS entry on `stream` (None: no such stream or group)."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # no such key
            return None
        return next((g for g in groups if as_str(g.get("name")) == self.names.group), None)

    async def _take_from(self, stream: str) -> list[Taken]:
        count = self.state.capacity()
        if count <= 0:
            return []
        try:
            reply = await self.redis.xreadgroup(self.names.group, self.cfg.consumer, {stream: ">"}, count=count)
        except ResponseError as e:
            if _gone(e):  # its stream is gone: nothing to take (a dead worker's registration is removed next)
                return []
            raise
        return [Taken(stream, entry_id, fields) for _, entries in reply or [] for entry_id, fields in entries]

    async def _remove_stream(self, name: str, stream: str) -> None:
        group = await self._group(stream)
        if group is None or (not group.get("lag") and not group.get("pending")):
            log.info("removing the request stream of worker %s, gone for good", name)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(self.names.worker_streams, name)
                pipe.hdel(self.names.loads, name)
                pipe.delete(stream, self.names.worker_prefixes(name))
                await pipe.execute()

    async def drop_idle_consumers(self) -> list[str]:
        """Delete consumers that hold nothing and have been idle over `consumer_idle_s` (not this one,
        which is live: it beats and reads); returns their names."""
        live = as_names(await self._live(**live_args(self.names)))
        removed = []
        for stream in await all_streams(self.redis, self.names):
            removed += await self._drop_idle(keys=[stream],
                                             args=[self.names.group, int(self.cfg.consumer_idle_s * 1000), *live])
        names = sorted({as_str(name) for name in removed})
        if names:
            log.info("removed %d idle consumer(s) holding no job from group %s: %s", len(names),
                     self.names.group, ", ".join(names[:10]) + (" ..." if len(names) > 10 else ""))
        return names

    async def _start_reclaimed(self, stream: str, entries: list[tuple[Any, Any]], jobs: TaskGroup) -> None:
        # Entries this worker holds are claimed back only because their idle time grew while Redis
        # was away (no refresh got through): the claim just renewed them; the jobs run on here.
        entries = [(e, f) for e, f in entries if (stream, as_str(e)) not in self.state.pending_entries]
        if not entries:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id, _ in entries:
                pipe.xpending_range(stream, self.names.group, entry_id, entry_id, 1)
            pending = await pipe.execute()
        batch = []
        for (entry_id, fields), info in zip(entries, pending, strict=True):
            deliveries = info[0]["times_delivered"] if info else 1
            log.info("reclaimed job entry %s (delivery %d)", as_str(entry_id), deliveries)
            self.on_reclaim(stream)
            batch.append(Taken(stream, entry_id, fields, deliveries=deliveries))
        await self.intake.start_batch(batch, jobs)


def _gone(error: ResponseError) -> bool:
    """NOGROUP: the stream, or this group on it, does not exist."""
    return "NOGROUP" in str(error)
