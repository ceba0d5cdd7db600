"""Graceful drain: the jobs a stopping worker could not finish go back to the queue at once.

Left pending, another worker would take them over only after `--claim-idle` (30 s by default) of
silence, the wait meant for a worker that died. A worker that stops on purpose knows better: once its
jobs have stopped and their events are written, it marks each unfinished entry as long idle
(`XCLAIM ... IDLE`, still its own: nothing is acked, nothing is lost if it dies right here) and
announces it on the hand-off channel; the other workers' reclaimers wake and take the entries over
through the takeover path that exists (intake resumes each job from its last event, with no gap and
no duplicate: clients/resume.py).
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from clients.backoff import TRANSIENT
from clients.protocol import Names
from workers.worker.state import WorkerState

log = logging.getLogger("streamer.worker")

# Far longer than any worker's --claim-idle: the entries qualify for every reclaimer's next pass.
HANDED_BACK_IDLE_MS = 10 * 24 * 3600 * 1000

# KEYS[1] = a request stream; ARGV[1] = group, ARGV[2] = consumer, ARGV[3] = idle (ms), ARGV[4..] = entry
# ids. Only entries still ours are marked (one another worker already took is left alone); returns
# how many were.
_HAND_BACK = """
local marked = 0
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    marked = marked + 1
  end
end
return marked
"""


class Handoff:
    def __init__(self, redis: Redis, names: Names, group: str, consumer: str, state: WorkerState) -> None:
        self.redis, self.names, self.group, self.consumer, self.state = redis, names, group, consumer, state
        self._hand_back = redis.register_script(_HAND_BACK)

    async def hand_back(self) -> int:
        """Hand every entry this worker still holds to the other workers; how many went."""
        entries = list(self.state.pending_entries)
        if not entries:
            return 0
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in entries:
            self.state.release_entry(stream, entry_id)  # the heartbeat stops keeping it fresh
            by_stream.setdefault(stream, []).append(entry_id)
        marked = 0
        try:
            for stream, ids in by_stream.items():
                marked += await self._hand_back(keys=[stream], args=[self.group, self.consumer,
                                                                     HANDED_BACK_IDLE_MS, *ids])
            await self.redis.publish(self.names.handoff, str(marked))
        except TRANSIENT as e:  # Redis is gone: the entries wait for --claim-idle, as a dead worker's do
            log.warning("worker %s: could not hand its jobs back (%s); others take them after --claim-idle",
                        self.consumer, e)
        log.info("worker %s: handed %d unfinished job(s) back to the queue", self.consumer, marked)
        return marked
