"""Attempts of a job, recorded in Redis before the engine runs it, so that a job that crashed its
worker's process (a segfault in a kernel, the OOM killer: nothing the engine step could contain) is
recognised on its next delivery instead of being handed from worker to worker.

The record lives in the request's fence hash (`Names.fence`): `epoch` (raised by every claim),
`started` (the epoch of the attempt that went into the engine), `seq` (the next event seq when it
did) and `alone` (whether it went in by itself). A new owner reading `started == epoch - 1` and no
event since `seq` knows the previous attempt died between entering the engine and its first output:
the job is a suspect. It then runs alone (no other job enters the engine with it until it has its
first output), so a second crash can only be its own: a suspect whose lone attempt died is
dead-lettered. Jobs that crashed in company get exactly one lone retry each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis

from clients.backoff import retry
from clients.protocol import Names

log = logging.getLogger("streamer.worker")

# KEYS[1] = fence hash; ARGV = epoch, seq, alone. Only the current owner records its attempt.
_RECORD_START = """
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'started', ARGV[1], 'seq', ARGV[2], 'alone', ARGV[3])
end
return 0
"""


@dataclass
class PreviousAttempt:
    """What the claim found about the attempt before it (intake.py's claim script returns it)."""

    started_seq: int = -1  # next seq when it entered the engine; -1: it never did
    alone: bool = False

    def died_in(self, next_seq: int, finished: bool) -> bool:
        """Whether it entered the engine and nothing was written after: it died (or was stopped) there."""
        return self.started_seq >= 0 and self.started_seq == next_seq and not finished


class Attempts:
    def __init__(self, redis: Redis, names: Names) -> None:
        self.names = names
        self._record = redis.register_script(_RECORD_START)

    async def record_start(self, request_id: str, epoch: int, next_seq: int, alone: bool) -> None:
        """Before the job enters the engine: the record a later owner judges this attempt by."""
        keys, args = [self.names.fence(request_id)], [epoch, next_seq, int(alone)]
        await retry("record attempt", log, lambda: self._record(keys=keys, args=args))
