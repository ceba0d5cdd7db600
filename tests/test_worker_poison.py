"""A job that makes the engine step fail is answered with an `internal` error event and a dead
letter; the worker keeps serving, and the jobs that shared its steps stream exactly what they would
have streamed without it."""

import pytest
import redis
from redis_worker_helpers import (
    check_complete,
    dead_letters,
    offline_tokens,
    read_events,
    running_worker,
    tokens_of,
    wait_for,
)
from test_fault_isolation import PoisonedRunner

from clients.protocol import Names
from clients.redis_client import AsyncClient
from streamer import SamplingParams

GOOD = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["first bystander", "second bystander", "third bystander"]


@pytest.mark.anyio
async def test_a_job_failing_the_engine_step_is_failed_alone(llama_ckpt, redis_url):
    r = redis.Redis.from_url(redis_url)
    async with running_worker(llama_ckpt, redis_url) as worker, AsyncClient(redis_url) as client:
        engine = worker.engine.engine
        engine.runner = PoisonedRunner(engine.runner, {"poison"}, after=3)
        ids = [await client.submit(p, params=GOOD) for p in PROMPTS[:2]]
        await client.submit("the poison", id="poison", params=GOOD)
        ids.append(await client.submit(PROMPTS[2], params=GOOD))
        await wait_for(lambda: r.xlen(Names().requests) == 0, timeout=60)
        later = await client.generate("after the poison", params=GOOD, timeout=30)
        assert not worker.stopping and worker.state.engine_error is None
    assert len(later.token_ids[0]) == 8

    expected = offline_tokens(llama_ckpt, PROMPTS, SamplingParams(**GOOD))
    for request_id, tokens in zip(ids, expected, strict=True):
        events = read_events(redis_url, request_id)
        assert check_complete(events)["type"] == "done" and tokens_of(events) == tokens
    poison = read_events(redis_url, "poison")
    assert [e["type"] for e in poison] == ["token"] * 3 + ["error"]  # what it streamed stands
    assert poison[-1]["code"] == "internal" and "poisoned row of poison" in poison[-1]["message"]
    (letter,) = dead_letters(redis_url)
    assert letter["reason"] == b"internal" and letter["id"] == b"poison"
    r.close()
