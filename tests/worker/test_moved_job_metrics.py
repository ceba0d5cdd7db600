"""A job a worker moved before running it (a raw job into its priority lane, workers/worker/lanes.py; the
same holds for one forwarded to its session's worker, affinity.py) is timed from the entry its submitter
added, not from the entry the move made: the wait before the move is the client's too
(docs/observability.md). A real redis-server and an in-process worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis
from redis_worker_helpers import NAMES, has_ended, running_worker, wait_for

from clients.names import Names

WAIT_S = 1.5  # how long the job waits in the default lane, where no worker reads yet


def sample_sum(worker: object, name: str) -> float:
    """The sum of histogram `name` over the worker's own registry."""
    registry = worker.metrics.registry  # type: ignore[attr-defined]
    return sum(s.value for m in registry.collect() for s in m.samples if s.name == f"{name}_sum")


@pytest.mark.anyio
async def test_a_moved_raw_jobs_queue_time_starts_when_it_was_pushed(llama_ckpt: Path, redis_url: str) -> None:
    lanes = Names(lanes=(-1,))
    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.zadd(lanes.streams, {lanes.lane(-1): -1})  # the lane, as a submitter that knows it registers it
        job = {"v": 1, "id": "moved-raw", "prompt": "x", "priority": -1, "params": {"max_tokens": 2}}
        pushed = await r.xadd(NAMES.requests, {"json": json.dumps(job)})  # as redis-cli XADD would
        await anyio.sleep(WAIT_S)
        async with running_worker(llama_ckpt, redis_url) as worker:
            await wait_for(lambda: has_ended(redis_url, "moved-raw"), 60)
            await wait_for(lambda: sample_sum(worker, "vllm:e2e_request_latency_seconds") > 0, 10)
            queue = sample_sum(worker, "vllm:request_queue_time_seconds")
            e2e = sample_sum(worker, "vllm:e2e_request_latency_seconds")
        lane = await r.xinfo_stream(lanes.lane(-1))  # it was moved: the lane's one entry (run and deleted since)
        assert lane["entries-added"] == 1
        moved_at = int(lane["last-generated-id"].split(b"-")[0])
        assert moved_at - int(pushed.split(b"-")[0]) >= WAIT_S * 1000  # the move made a later entry
    finally:
        await r.aclose()
    assert WAIT_S <= queue <= e2e < time.time() - int(pushed.split(b"-")[0]) / 1000
