"""Batch lines never keep an interactive job waiting in Redis for a seat (docs/scheduling.md): a worker whose
engine seats are all held by batch lines still takes interactive jobs (the engine preempts batch sequences
for them, tests/engine/test_scheduler_batch.py), but no more batch lines. First the take script on its own
(workers/worker/streams.py), then a worker on a scripted engine with seats. Redis is real."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis_worker_helpers import wait_for
from scripted_engine import ScriptedEngine, answer, scripted_worker

from clients.names import BATCH_PRIORITY, Names
from clients.protocol import decode_job
from clients.redis_client import AsyncClient
from workers.worker.streams import StreamSet

NAMES = Names()
ME = "w-1"


async def submit(client: AsyncClient, *ids: str, priority: int = 0) -> None:
    for rid in ids:
        await client.submit("p", id=rid, priority=priority, params={"max_tokens": 2})


@pytest.mark.anyio
async def test_the_take_gives_batch_lines_only_the_free_room(redis_url: str) -> None:
    async with AsyncClient(redis_url, names=NAMES, routing="shared") as client, aioredis.Redis.from_url(redis_url) as r:
        await submit(client, "b0", "b1", "b2", priority=BATCH_PRIORITY)
        await submit(client, "i0", "i1")
        streams = StreamSet(r, NAMES, ME)
        taken = await streams.take(4, batch=3)  # two interactive, then batch lines up to three in all
        assert [decode_job(t.fields).id for t in taken] == ["i0", "i1", "b0"]
        assert await streams.take(4, batch=0) == []
        assert await streams.wait_any(50, batch=False) == []  # blocks on the interactive lanes alone
        await submit(client, "i2")
        assert [decode_job(t.fields).id for t in await streams.wait_any(50, batch=False)] == ["i2"]
        assert [decode_job(t.fields).id for t in await streams.take(4)] == ["b1", "b2"]  # batch: as `count`


@dataclass
class SeatedEngine(ScriptedEngine):
    """A scripted engine with `seats` (max_num_seqs) and admission capacity as the real one counts it: none
    left once its requests fill the seats."""

    seats: int = 2

    def admission_capacity(self) -> int:
        return max(0, self.seats - (len(self.calls) - len(self.closed)))

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "max_num_seqs": self.seats}


@pytest.mark.anyio
async def test_a_worker_full_of_batch_lines_takes_interactive_jobs_and_no_more_batch(redis_url: str) -> None:
    first, last = answer()
    engine = SeatedEngine({"p": [[first, 30.0, last]]}, seats=2)  # every request holds its seat for 30 s
    async with scripted_worker(engine, redis_url, block_ms=100) as worker, \
            AsyncClient(redis_url, names=NAMES, routing="shared") as client:
        await submit(client, "b0", "b1", "b2", priority=BATCH_PRIORITY)
        await wait_for(lambda: len(engine.calls) == 2, timeout=10)  # both seats held by batch lines
        await submit(client, "i0", "i1", "i2")
        await wait_for(lambda: len(engine.calls) == 4, timeout=10)
        await anyio.sleep(0.5)  # nothing more is taken: i2 would need an interactive job's seat, b2 any
        # Jobs read together enter the engine in no set order (each task has its own round trips first).
        calls = [(c.request_id, c.priority) for c in engine.calls]
        assert sorted(calls[:2]) == [("b0", BATCH_PRIORITY), ("b1", BATCH_PRIORITY)]
        assert sorted(calls[2:]) == [("i0", 0), ("i1", 0)]
        assert worker.state.urgent_capacity() == 0 and worker.state.capacity() == 0
