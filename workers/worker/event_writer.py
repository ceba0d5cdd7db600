"""Writes request events to Redis: batched, pipelined, idempotent, retried until Redis takes them.

Job tasks only append to an in-memory list (never awaiting Redis), so a slow or restarting Redis
cannot stall generation. The writer sends everything that accumulated while its previous round
trip was in flight as one pipeline: all events of one engine step go out together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from redis.asyncio import Redis

from clients.backoff import TRANSIENT, Backoff
from clients.protocol import Names, encode, event_stream_id

log = logging.getLogger("streamer.worker")

# Append each event under its explicit id 0-(seq+1) and publish it only if the append succeeded: an
# event Redis already holds (a retried pipeline, or two workers resuming one request) is skipped, so
# neither the stream nor the channel ever sees a seq twice. One call carries a whole flush:
# KEYS = event streams; ARGV = ttl, then per key: count, channel, field, count x (entry id, payload).
_APPEND_AND_PUBLISH = """
local pos, written = 2, 0
for k = 1, #KEYS do
  local n, channel, field = tonumber(ARGV[pos]), ARGV[pos + 1], ARGV[pos + 2]
  pos = pos + 3
  for _ = 1, n do
    local r = redis.pcall('XADD', KEYS[k], ARGV[pos], field, ARGV[pos + 1])
    if type(r) ~= 'table' or not r.err then
      redis.call('PUBLISH', channel, ARGV[pos + 1])
      written = written + 1
    end
    pos = pos + 2
  end
  redis.call('PEXPIRE', KEYS[k], ARGV[1])
end
return written
"""


@dataclass
class Write:
    """Events of one request (in seq order) and, with the terminal event, the job entry to ack."""

    request_id: str
    encoding: str
    events: list[dict] = field(default_factory=list)
    ack_entry: str | None = None
    on_written: Callable[[], None] | None = None  # called once Redis holds the events (and the ack)


class EventWriter:
    def __init__(self, redis: Redis, names: Names, events_ttl_ms: int) -> None:
        self.redis, self.names, self.ttl_ms = redis, names, events_ttl_ms
        self._script = redis.register_script(_APPEND_AND_PUBLISH)
        self._pending: list[Write] = []
        self._wake = anyio.Event()
        self._closed = False
        self._idle = anyio.Event()
        self._idle.set()
        self.round_trips = 0

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
                await self._send(batch)
            except TRANSIENT as e:
                self._pending[:0] = batch  # nothing is lost: the retry is idempotent
                await backoff.sleep(e)
                continue
            except BaseException:
                self._pending[:0] = batch  # cancelled mid-send: keep it for a later drain
                raise
            backoff.reset()
            for write in batch:
                if write.on_written is not None:
                    write.on_written()

    async def _send(self, batch: list[Write]) -> None:
        names = self.names
        keys: list[str] = []
        args: list[str | bytes | int] = [self.ttl_ms]
        acks = [w for w in batch if w.ack_entry is not None]
        for w in batch:
            if w.events:
                keys.append(names.events(w.request_id))
                args += [len(w.events), names.tokens(w.request_id), w.encoding]
                for event in w.events:
                    args += [event_stream_id(event["seq"]), encode(event, w.encoding)]
        async with self.redis.pipeline(transaction=False) as pipe:
            if keys:
                await self._script(keys=keys, args=args, client=pipe)
            if acks:
                # Finished jobs leave the requests stream; their id claims live as long as their events.
                entries = [w.ack_entry for w in acks]
                pipe.xack(names.requests, names.group, *entries)
                pipe.xdel(names.requests, *entries)
                for w in acks:
                    pipe.pexpire(names.job(w.request_id), self.ttl_ms)
            replies = await pipe.execute(raise_on_error=False)
        self.round_trips += 1
        for reply in replies:
            # A command Redis refused (not a dropped connection, which raises) will not succeed on a
            # retry either, e.g. NOGROUP after Redis lost its data: log it and go on.
            if isinstance(reply, Exception):
                if isinstance(reply, TRANSIENT):
                    raise reply
                log.warning("event writer: Redis refused a write: %s", reply)
