"""Job intake of the Redis worker: reading the consumer group as capacity allows, then claiming each
entry's request id and reading its resume state before one task per job starts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from clients import scripts
from clients.backoff import TRANSIENT, Backoff, retry
from clients.errors import ProtocolError
from clients.protocol import decode_job
from clients.resume import resume_state
from workers.worker.affinity import Affinity
from workers.worker.attempts import PreviousAttempt
from workers.worker.config import WorkerConfig
from workers.worker.job import JobRunner
from workers.worker.lanes import moved_from, register_lanes
from workers.worker.state import Delivery, WorkerState, as_str
from workers.worker.streams import StreamSet, Taken

log = logging.getLogger("streamer.worker")
Reader = Callable[[int, int], Awaitable[list[Taken]]]  # up to this many new entries, batch lines up to the second

# Claim a request id for a job entry: the first entry to claim an id owns it (later ones are
# duplicates). The owner's claim raises the id's fence (ownership epoch), so writes of a worker that
# claimed it before (and was presumed dead) are refused from now on; the events read after this in
# the same round trip are all the new owner resumes from. It also hands back the record of the
# previous attempt (attempts.py): the seq it entered the engine at (-1: it never did), and whether alone.
# An entry a worker moved (a lane, a session's worker: lanes.py, affinity.py) names the entry it was
# pushed as; a claim its submitter made for that one passes to it.
# KEYS = id claim, fence hash; ARGV = entry id, ttl, the entry it was moved from ('': none). Returns
# {owner entry, epoch (0 when not the owner), previous attempt's seq, alone}.
_CLAIM = """
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
local owner = redis.call('GET', KEYS[1])
if ARGV[3] ~= '' and owner == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  owner = ARGV[1]
end
if owner ~= ARGV[1] then
  return {owner, 0, -1, 0}
end
local prev = redis.call('HMGET', KEYS[2], 'epoch', 'started', 'seq', 'alone')
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if prev[1] and prev[2] == prev[1] then
  return {owner, epoch, tonumber(prev[3]), tonumber(prev[4])}
end
return {owner, epoch, -1, 0}
"""


class Intake:
    """Reads entries while the engine has room and starts a `JobRunner` task for each in `jobs`."""

    def __init__(self, redis: Redis, config: WorkerConfig, state: WorkerState, runner: JobRunner,
                 streams: StreamSet, affinity: Affinity | None = None) -> None:
        self.redis, self.cfg, self.names = redis, config, config.names
        self.state, self.runner, self.streams = state, runner, streams
        self.affinity = affinity or Affinity(redis, config.names, config.consumer)
        self._claim = redis.register_script(_CLAIM)

    async def ensure_group(self) -> None:
        """The group on every stream this worker reads from the start; the lanes it was configured with
        (`--priority-lanes`) registered, so that jobs pushed without them are moved into them (lanes.py)."""
        backoff = Backoff("create group", log)
        lanes = {self.names.lane(cutoff): cutoff for cutoff in self.names.lanes}
        await retry("register lanes", log, lambda: register_lanes(self.redis, self.names, lanes))
        for stream in [*self.names.request_streams, *lanes, self.streams.own]:
            while True:
                try:
                    # From id 0: jobs pushed before the first worker ever started are served too.
                    await self.redis.xgroup_create(stream, self.names.group, id="0", mkstream=True)
                    break
                except ResponseError as e:
                    if "BUSYGROUP" in str(e):
                        break
                    raise
                except TRANSIENT as e:
                    await backoff.sleep(e)

    async def read_loop(self, jobs: TaskGroup) -> None:
        """Take jobs as capacity allows: in lane and fair-share order from every registered stream
        (streams.py), or, over sharded streams, one XREADGROUP over them all; on a cluster, whose
        shards sit in different slots, one reader per shard, each reading its share of the capacity
        (together they may overshoot by a job each: the engine queues those)."""
        streams = self.names.request_streams
        if len(streams) == 1:  # lanes, the batch lane among them: interactive jobs may take batch lines' seats
            await self._read_loop(self._take_or_wait, self.streams.take, jobs, urgent=True)
        elif not self.names.cluster:
            await self._read_loop(*self._sharded(streams), jobs)
        else:
            async with anyio.create_task_group() as readers:
                for stream in streams:
                    readers.start_soon(self._read_loop, *self._sharded([stream]), jobs, len(streams))

    async def _read_loop(self, first: Reader, more: Reader, jobs: TaskGroup, readers: int = 1,
                         urgent: bool = False) -> None:
        """Wait for capacity, `first(count, batch)` (blocks until something comes), then, after a partial
        read, `more(rest, batch)` (does not block), and start what was taken. `urgent`: jobs more urgent
        than batch lines count the seats of the batch lines held here as theirs (the engine preempts
        those), batch lines only the engine's free room (WorkerState.urgent_capacity)."""
        backoff = Backoff("read", log)
        while True:
            count = await self.state.wait_capacity(urgent)
            batch = min(count, self.state.capacity())
            if readers > 1:
                count = max(1, count // readers)
            try:
                taken = await first(count, batch)
                backoff.reset()
            except ResponseError as e:
                await self.refused("read", e, backoff)
                continue
            except TRANSIENT as e:
                await backoff.sleep(e)
                continue
            if 0 < len(taken) < count and self.cfg.read_linger_ms > 0:
                # Jobs pushed in a burst arrive over a few ms: gather them so they enter the engine
                # together (one prefill batch) instead of one step apart.
                await anyio.sleep(self.cfg.read_linger_ms / 1000)
                with contextlib.suppress(*TRANSIENT):
                    taken += await more(count - len(taken), batch - len(taken))
            await self.start_batch(taken, jobs)

    async def _take_or_wait(self, count: int, batch: int) -> list[Taken]:
        """In lane and fair-share order (streams.py); all empty: the next job wherever it comes (a batch
        line only if `batch` allows one)."""
        return await self.streams.take(count, batch) or await self.streams.wait_any(self.cfg.block_ms, batch > 0)

    def _sharded(self, streams: list[str]) -> tuple[Reader, Reader]:
        """Readers of sharded streams: one XREADGROUP over them, blocking or not."""
        async def read(count: int, block_ms: int | None) -> list[Taken]:  # no lanes here: `batch` is unused
            reply = await self.redis.xreadgroup(self.names.group, self.cfg.consumer, dict.fromkeys(streams, ">"),
                                                count=count, block=block_ms)
            return [Taken(as_str(stream), entry_id, fields) for stream, entries in reply or []
                    for entry_id, fields in entries]

        return (lambda count, _: read(count, self.cfg.block_ms)), (lambda count, _: read(count, None))

    async def refused(self, what: str, error: ResponseError, backoff: Backoff) -> None:
        """Redis answered with an error: a lost group is recreated; anything else (out of memory, a
        key of the wrong type) is logged and retried with backoff, the worker stays up."""
        if "NOGROUP" in str(error):
            log.warning("consumer group missing (Redis lost its data?): creating it again")
            self.streams.forget_groups()
            await self.ensure_group()
        else:
            log.error("%s: Redis refused: %s", what, error)
            await backoff.sleep(error)

    async def start_batch(self, entries: list[Taken], jobs: TaskGroup) -> None:
        """Decode a batch of taken entries, forward those of a session another worker holds there and
        record this worker as the others' session worker (affinity.py), claim their ids in entry
        order (the first of two jobs with the same id wins), read their resume state in one round
        trip, then start one task per job in `jobs`."""
        batch = await self.affinity.place([self._decode(t) for t in entries])
        with_ids = [d for d in batch if d.request_id is not None]
        if with_ids:
            replies = await retry("load jobs", log, lambda: self._load_pipeline(with_ids))
            for i, d in enumerate(with_ids):
                self._load(d, replies[3 * i: 3 * i + 3])
        for d in batch:
            self.state.job_read(d.stream, d.entry_id, d.request_id or "")
            jobs.start_soon(self.runner.run, d, name=f"job {d.entry_id}")

    def _decode(self, t: Taken) -> Delivery:
        fields, origin = moved_from(t.fields)
        d = Delivery(as_str(t.entry_id), fields, t.deliveries, stream=t.stream, charged_to=t.tenant,
                     charged=t.charged, origin=origin)
        try:
            d.job = decode_job(fields, self.cfg.limits)
        except ProtocolError as e:
            d.error = e
        return d

    @staticmethod
    def _load(d: Delivery, replies: list[Any]) -> None:
        """Fill in what Redis said about the delivery's id: its owner, earlier events, a cancel marker."""
        claim, events, cancelled = replies
        try:
            for reply in (claim, events, cancelled):
                if isinstance(reply, Exception):  # e.g. WRONGTYPE: a key of ours holds something else
                    raise ValueError(str(reply))
            owner, epoch, started_seq, alone = claim
            d.ours, d.epoch, d.cancelled = as_str(owner) == d.entry_id, int(epoch), bool(cancelled)
            d.state = resume_state(events)
            d.previous = PreviousAttempt(int(started_seq), bool(alone))
        except (ValueError, KeyError, TypeError) as e:  # someone else wrote there: stay out of it
            d.job, d.error = None, ProtocolError("damaged_events", f"keys of {d.request_id!r}: {e}")

    async def _load_pipeline(self, batch: list[Delivery]) -> list[Any]:
        ttl = int(self.cfg.events_ttl_s * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in batch:
                request_id = d.request_id or ""
                await scripts.queue(pipe, self._claim, [self.names.job(request_id), self.names.fence(request_id)],
                                    [d.entry_id, ttl, d.origin])
                pipe.xrange(self.names.events(request_id))
                pipe.exists(self.names.cancelled(request_id))
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(reply, NoScriptError) for reply in replies):  # a fresh or restarted cluster node
            await scripts.load(self.redis, self._claim)
            return await self._load_pipeline(batch)
        return replies
