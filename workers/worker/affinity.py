"""Session affinity kept by the workers themselves (docs/scheduling.md), for jobs from any submitter.

The worker that takes a job of a `session` records itself as the session's worker at once (the key
`Names.session`), before the job enters its engine: a follow-up sent the moment the answer ends (an
agent after a tool call) already finds where the conversation's KV is. A router (the gateway, the
Python client) reads that key; a job pushed without one (a plain `XADD llm:requests`) lands on
whichever worker reads it first, and that worker, when the session's worker is another live one
with room, forwards the entry to that worker's own stream instead of running it: XADD there, XACK
and XDEL here, in one script, so the job is in exactly one stream at every moment and is run once.
A session's worker that is dead, draining or full (the load a router counts: jobs it holds from the
shared lanes plus its own stream's length, against 1.5 x its seats) is not waited for: the job runs
here and the session is this worker's from now on.

Only entries read for the first time from a shared lane are forwarded: an entry from a worker's own
stream was placed there on purpose, and a reclaimed one may have run already.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from clients import scripts
from clients.backoff import retry
from clients.heartbeats import STALE_MS
from clients.names import BATCH_PRIORITY, Names
from clients.routing import MAX_LOAD
from workers.worker.lanes import MOVED_FROM
from workers.worker.state import Delivery, as_str

log = logging.getLogger("streamer.worker")

SESSION_TTL_MS = 600_000  # a session quiet this long has no home worker any more
FORWARDED, HERE, GONE = 1, 0, -1  # the script's answers

# KEYS[1] = the stream the entry was read from, KEYS[2] = the session's key, KEYS[3] = heartbeats,
# KEYS[4] = loads, KEYS[5] = the session worker's stats hash, KEYS[6] = its own stream; ARGV[1] =
# group, ARGV[2] = this worker, ARGV[3] = the session's worker as read before, ARGV[4] = entry id,
# ARGV[5] = STALE_MS, ARGV[6] = most load per seat, ARGV[7] = session TTL (ms), ARGV[8] = the entry
# it was first pushed as, ARGV[9..] = its fields. Returns FORWARDED, HERE (the session is now this
# worker's) or GONE (the entry is no longer this worker's: an earlier try of the same call moved it).
_FORWARD = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)
if not p[1] or p[1][2] ~= ARGV[2] then
  return -1
end
if redis.call('GET', KEYS[2]) == ARGV[3] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local beat = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[3]) or '0') or 0
  local stats = redis.call('HMGET', KEYS[5], 'max_num_seqs', 'draining')
  local seats = tonumber(stats[1] or '0') or 0
  local load = (tonumber(redis.call('HGET', KEYS[4], ARGV[3]) or '0') or 0) + redis.call('XLEN', KEYS[6])
  if now - beat <= tonumber(ARGV[5]) and stats[2] ~= '1' and load < tonumber(ARGV[6]) * seats then
    local fields = {}
    for i = 9, #ARGV do
      fields[#fields + 1] = ARGV[i]
    end
    fields[#fields + 1] = '@MOVED_FROM@'
    fields[#fields + 1] = ARGV[8]
    redis.call('XADD', KEYS[6], '*', unpack(fields))
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[4])
    redis.call('XDEL', KEYS[1], ARGV[4])
    return 1
  end
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[7])
return 0
""".replace("@MOVED_FROM@", MOVED_FROM)


class Affinity:
    """`place(batch)`: records this worker as the session's worker of the jobs it keeps, forwards the
    others; `on_forward(delivery)` is called for each forwarded one (its charge, metrics)."""

    def __init__(self, redis: Redis, names: Names, consumer: str,
                 on_forward: Callable[[Delivery], None] = lambda d: None) -> None:
        self.redis, self.names, self.consumer, self.on_forward = redis, names, consumer, on_forward
        self._forward = redis.register_script(_FORWARD)
        self._worker_streams = names.worker_requests("")  # every worker's own stream starts so

    async def place(self, batch: list[Delivery]) -> list[Delivery]:
        """The deliveries of `batch` to run here (those forwarded left, in one step each)."""
        sessions = [d for d in batch if d.job is not None and d.job.session]
        if not sessions:
            return batch
        replies = await retry("session affinity", log, lambda: self._place(sessions))
        gone = set()
        for d, reply in zip(sessions, replies, strict=True):
            if isinstance(reply, Exception):  # e.g. a key of ours holding something else: run it here
                log.warning("request %s: session affinity not recorded: %s", d.request_id, reply)
            elif reply in (FORWARDED, GONE):
                gone.add(id(d))
                if reply == FORWARDED:
                    log.debug("request %s: forwarded to the worker holding session %r", d.request_id,
                              d.job and d.job.session)
                    self.on_forward(d)
        return [d for d in batch if id(d) not in gone]

    def _may_forward(self, d: Delivery) -> bool:
        """Read for the first time from a shared lane, and not a batch line (those wait for spare seats
        only, never in a worker's own stream); sharded streams sit in slots apart from the workers'."""
        assert d.job is not None
        return (d.deliveries == 1 and not d.stream.startswith(self._worker_streams) and self.names.shards == 1
                and d.job.priority < BATCH_PRIORITY)

    async def _place(self, sessions: list[Delivery]) -> list[Any]:
        keys = [self.names.session(d.job.session) for d in sessions if d.job is not None and d.job.session]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            holders = await pipe.execute(raise_on_error=False)
        async with self.redis.pipeline(transaction=False) as pipe:
            for d, key, holder in zip(sessions, keys, holders, strict=True):
                holder = None if holder is None or isinstance(holder, Exception) else as_str(holder)
                if holder is not None and holder != self.consumer and self._may_forward(d):
                    await scripts.queue(pipe, self._forward, self._keys(d, key, holder), self._args(d, holder))
                else:
                    pipe.set(key, self.consumer, px=SESSION_TTL_MS)
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(reply, NoScriptError) for reply in replies):  # a fresh or restarted cluster node
            await scripts.load(self.redis, self._forward)
            return await self._place(sessions)
        return [HERE if reply is True else reply for reply in replies]

    def _keys(self, d: Delivery, key: str, holder: str) -> list[str]:
        n = self.names
        return [d.stream, key, n.heartbeats, n.loads, n.worker(holder), n.worker_requests(holder)]

    def _args(self, d: Delivery, holder: str) -> list[Any]:
        fields = [x for pair in (d.fields or {}).items() for x in pair]
        return [self.names.group, self.consumer, holder, d.entry_id, STALE_MS, MAX_LOAD, SESSION_TTL_MS,
                d.origin or d.entry_id, *fields]
