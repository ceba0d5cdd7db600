"""Writes request events to Redis: batched, pipelined, idempotent, retried until Redis takes them.

Job tasks only append to an in-memory list (never awaiting Redis), so a slow or restarting Redis
cannot stall generation. The writer sends everything that accumulated while its previous round
trip was in flight as one pipeline: all events of one engine step go out together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from clients import scripts
from clients.backoff import TRANSIENT, Backoff
from clients.protocol import Names, encode, event_stream_id

log = logging.getLogger("streamer.worker")

# Append each event under its explicit id 0-(seq+1) and publish it only if the append succeeded: an
# event Redis already holds (a retried pipeline) is skipped, so neither the stream nor the channel
# ever sees a seq twice. Each request's events carry the ownership epoch its worker claimed the job
# with; if a later claim (a takeover) raised the request's fence, they are refused whole and the
# request is reported, so a worker presumed dead can never write into the new owner's answer.
# One call carries a whole flush (on a cluster: everything of one slot): KEYS = per request: event
# stream, fence; ARGV = ttl, then per request: count, channel, field, epoch, count x (entry id,
# payload). Returns the refused requests (their positions in KEYS / 2, from 1). A fence Redis does
# not hold (it lost its data) refuses nothing. On a cluster the channel is a shard channel (SPUBLISH).
_APPEND_AND_PUBLISH = """
local pos, refused = 2, {}
for k = 1, #KEYS, 2 do
  local n, channel, field, epoch = tonumber(ARGV[pos]), ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3]
  pos = pos + 4
  local current = redis.call('HGET', KEYS[k + 1], 'epoch')
  if current and current ~= epoch then
    refused[#refused + 1] = (k + 1) / 2
    pos = pos + 2 * n
  else
    for _ = 1, n do
      local r = redis.pcall('XADD', KEYS[k], ARGV[pos], field, ARGV[pos + 1])
      if type(r) ~= 'table' or not r.err then
        redis.call('PUBLISH', channel, ARGV[pos + 1])
      end
      pos = pos + 2
    end
    redis.call('PEXPIRE', KEYS[k], ARGV[1])
    redis.call('PEXPIRE', KEYS[k + 1], ARGV[1])
  end
end
return refused
"""

# Finished jobs leave the requests stream (XACK + XDEL) unless a later claim fenced them off (the new
# owner acks); their id claim and fence live as long as their events. On a cluster the stream and the
# request's keys are in different slots: the acks follow in a second round trip instead, for the
# jobs whose final events were taken (acking those is right whoever holds the entry by then: the
# job is answered).
# KEYS = requests stream, then per job: fence, id claim; ARGV = group, ttl, then per job: entry, epoch.
# Returns the refused jobs (their positions, from 1).
_ACK_IF_OWNER = """
local refused = {}
for j = 2, #KEYS, 2 do
  local entry, epoch, current = ARGV[j + 1], ARGV[j + 2], redis.call('HGET', KEYS[j], 'epoch')
  if current and current ~= epoch then
    refused[#refused + 1] = j / 2
  else
    redis.call('PEXPIRE', KEYS[j], ARGV[2])
    redis.call('PEXPIRE', KEYS[j + 1], ARGV[2])
    redis.call('XACK', KEYS[1], ARGV[1], entry)
    redis.call('XDEL', KEYS[1], entry)
  end
end
return refused
"""


@dataclass
class Write:
    """Events of one request (in seq order) and, with the terminal event, the job entry to ack."""

    request_id: str
    encoding: str
    events: list[dict] = field(default_factory=list)
    ack_entry: str | None = None
    ack_stream: str = ""  # the request stream holding `ack_entry` (default: Names.requests)
    on_written: Callable[[], None] | None = None  # called once Redis holds the events (and the ack)
    epoch: int = 0  # the ownership epoch the job was claimed with (Names.fence)


class EventWriter:
    """`on_fenced(request_id, epoch)`: Redis refused a request's writes because another worker
    claimed the job since (this one was presumed dead); that job must stop here at once.
    `on_round_trip(seconds)`: the time of each round trip that went through (metrics)."""

    def __init__(self, redis: Redis, names: Names, events_ttl_ms: int,
                 on_fenced: Callable[[str, int], None] = lambda request_id, epoch: None,
                 on_round_trip: Callable[[float], None] = lambda seconds: None) -> None:
        self.redis, self.names, self.ttl_ms, self.on_fenced = redis, names, events_ttl_ms, on_fenced
        self.on_round_trip = on_round_trip
        self.cluster = names.cluster
        self._append = redis.register_script(
            _APPEND_AND_PUBLISH.replace("'PUBLISH'", "'SPUBLISH'") if self.cluster else _APPEND_AND_PUBLISH)
        self._ack = redis.register_script(_ACK_IF_OWNER)
        self._pending: list[Write] = []
        self._wake = anyio.Event()
        self._closed = False
        self._idle = anyio.Event()
        self._idle.set()
        self.round_trips = 0
        self._slowest = 0.0

    def take_slowest_round_trip(self) -> float:
        """The slowest round trip (seconds) since the last call (for slow-step traces)."""
        slowest, self._slowest = self._slowest, 0.0
        return slowest

    async def _execute(self, pipe: Any) -> list[Any]:
        started = time.monotonic()
        replies = await pipe.execute(raise_on_error=False)
        elapsed = time.monotonic() - started
        self.on_round_trip(elapsed)
        self._slowest = max(self._slowest, elapsed)
        self.round_trips += 1
        return replies

    def put(self, write: Write) -> None:
        self._pending.append(write)
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    def close(self) -> None:
        """Finish what is queued, then let `run` return."""
        self._closed = True
        self._wake.set()

    async def wait_idle(self) -> None:
        """Until everything put so far is in Redis."""
        await self._idle.wait()

    async def run(self) -> None:
        backoff = Backoff("event writer", log)
        while True:
            if not self._pending:
                self._idle.set()
                if self._closed:
                    return
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            batch, self._pending = self._pending, []
            try:
                fenced = await self._send(batch)
            except NoScriptError as e:
                self._pending[:0] = batch
                await scripts.load(self.redis, self._append, self._ack)
                await backoff.sleep(e)
                continue
            except TRANSIENT as e:
                self._pending[:0] = batch  # nothing is lost: the retry is idempotent
                await backoff.sleep(e)
                continue
            except BaseException:
                self._pending[:0] = batch  # cancelled mid-send: keep it for a later drain
                raise
            backoff.reset()
            for write in batch:
                if (write.request_id, write.epoch) in fenced:
                    continue
                if write.on_written is not None:
                    write.on_written()
            for request_id, epoch in fenced:
                self.on_fenced(request_id, epoch)

    async def _send(self, batch: list[Write]) -> set[tuple[str, int]]:
        """The events, then the acks of finished jobs, both fenced; returns the (request, epoch)s
        Redis refused. One round trip on a single Redis; on a cluster one script per slot, all in
        one pipeline, then the acks."""
        groups = self._by_slot([w for w in batch if w.events])
        acks = [w for w in batch if w.ack_entry is not None]
        async with self.redis.pipeline(transaction=False) as pipe:
            for writes in groups:
                await scripts.queue(pipe, self._append, *self._append_args(writes))
            ack_groups = self._by_stream(acks) if not self.cluster else []
            for writes in ack_groups:
                await scripts.queue(pipe, self._ack, *self._ack_args(writes))
            replies = await self._execute(pipe)
        self._check(replies)
        parts = [*groups, *ack_groups]
        fenced = {(writes[k - 1].request_id, writes[k - 1].epoch) for writes, reply in zip(parts, replies)
                  if not isinstance(reply, Exception) for k in reply}
        if acks and self.cluster:
            await self._ack_apart([w for w in acks if (w.request_id, w.epoch) not in fenced])
        return fenced

    def _by_slot(self, writes: list[Write]) -> list[list[Write]]:
        if not self.cluster or not writes:
            return [writes] if writes else []
        slots: dict[int, list[Write]] = {}
        for w in writes:
            slots.setdefault(key_slot(self.names.events(w.request_id).encode()), []).append(w)
        return list(slots.values())

    def _by_stream(self, acks: list[Write]) -> list[list[Write]]:
        streams: dict[str, list[Write]] = {}
        for w in acks:
            streams.setdefault(w.ack_stream or self.names.requests, []).append(w)
        return list(streams.values())

    async def _ack_apart(self, acks: list[Write]) -> None:
        names = self.names
        async with self.redis.pipeline(transaction=False) as pipe:
            for w in acks:
                pipe.xack(w.ack_stream or names.requests, names.group, w.ack_entry or "")
                pipe.xdel(w.ack_stream or names.requests, w.ack_entry or "")
                pipe.pexpire(names.job(w.request_id), self.ttl_ms)
                pipe.pexpire(names.fence(w.request_id), self.ttl_ms)
            replies = await self._execute(pipe)
        self._check(replies)

    def _check(self, replies: list) -> None:
        for reply in replies:
            # A command Redis refused (not a dropped connection, which raises) will not succeed on a
            # retry either, e.g. NOGROUP after Redis lost its data: log it and go on.
            if isinstance(reply, NoScriptError):  # a node restarted: load the scripts and retry
                raise reply
            if isinstance(reply, Exception):
                if isinstance(reply, TRANSIENT):
                    raise reply
                log.warning("event writer: Redis refused a write: %s", reply)

    def _append_args(self, writes: list[Write]) -> tuple[list[str], list[str | bytes | int]]:
        names = self.names
        keys: list[str] = []
        args: list[str | bytes | int] = [self.ttl_ms]
        for w in writes:
            keys += [names.events(w.request_id), names.fence(w.request_id)]
            args += [len(w.events), names.tokens(w.request_id), w.encoding, w.epoch]
            for event in w.events:
                args += [event_stream_id(event["seq"]), encode(event, w.encoding)]
        return keys, args

    def _ack_args(self, acks: list[Write]) -> tuple[list[str], list[str | bytes | int]]:
        names = self.names
        keys = [acks[0].ack_stream or names.requests]  # acks of one stream
        args: list[str | bytes | int] = [names.group, self.ttl_ms]
        for w in acks:
            keys += [names.fence(w.request_id), names.job(w.request_id)]
            args += [w.ack_entry or "", w.epoch]
        return keys, args
