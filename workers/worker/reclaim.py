"""Reclaiming the entries of dead workers: an entry nobody refreshed for `claim_idle_s` is taken over
and goes through intake again, which resumes it from its event stream (clients/resume.py).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from clients.backoff import TRANSIENT, Backoff
from workers.worker.config import WorkerConfig
from workers.worker.intake import Intake
from workers.worker.state import WorkerState, as_str

log = logging.getLogger("streamer.worker")


class Reclaimer:
    """Takes over entries of dead workers and hands them to `Intake` like freshly read ones."""

    def __init__(self, redis: Redis, config: WorkerConfig, state: WorkerState, intake: Intake) -> None:
        self.redis, self.cfg, self.names = redis, config, config.names
        self.state, self.intake = state, intake

    async def claim_loop(self, jobs: TaskGroup) -> None:
        """Take over entries whose worker stopped refreshing them (dead), oldest first."""
        backoff = Backoff("reclaim", log)
        idle_ms = int(self.cfg.claim_idle_s * 1000)
        while True:
            await anyio.sleep(self.cfg.claim_idle_s / 2)
            cursor = "0-0"
            try:
                while (count := self.state.capacity()) > 0:
                    cursor, entries, *_ = await self.redis.xautoclaim(
                        self.names.requests, self.names.group, self.cfg.consumer, idle_ms,
                        start_id=cursor, count=count)
                    if entries:
                        await self._start_reclaimed(entries, jobs)
                    if cursor in (b"0-0", "0-0"):
                        break
                backoff.reset()
            except ResponseError as e:
                await self.intake.refused("reclaim", e, backoff)
            except TRANSIENT as e:
                await backoff.sleep(e)

    async def _start_reclaimed(self, entries: list[tuple[Any, Any]], jobs: TaskGroup) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id, _ in entries:
                pipe.xpending_range(self.names.requests, self.names.group, entry_id, entry_id, 1)
            pending = await pipe.execute()
        batch = []
        for (entry_id, fields), info in zip(entries, pending, strict=True):
            deliveries = info[0]["times_delivered"] if info else 1
            log.info("reclaimed job entry %s (delivery %d)", as_str(entry_id), deliveries)
            batch.append((entry_id, fields, deliveries))
        await self.intake.start_batch(batch, jobs)
