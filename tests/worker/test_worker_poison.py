"""A job that makes the engine step fail is answered with an `internal` error event and a dead
letter; the worker keeps serving, and the jobs that shared its steps stream exactly what they would
have streamed without it."""

import pytest
import redis
from redis_worker_helpers import (
    ROOT,
    check_complete,
    dead_letters,
    offline_tokens,
    read_events,
    running_worker,
    tokens_of,
    wait_for,
    worker_process,
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
        engine.executor = PoisonedRunner(engine.executor, {"poison"}, after=3)
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


def exited(proc):
    return proc.poll() is not None


@pytest.mark.anyio
async def test_a_job_that_kills_its_worker_process_is_dead_lettered_not_handed_on(llama_ckpt, redis_url, tmp_path):
    """Workers whose process dies on the spot (os._exit) in any step holding the poison job. It
    first dies with bystanders that entered the engine with it: each of those is then run alone
    once; the poison's lone attempt kills a second worker, and the third dead-letters it instead of
    dying too. The bystanders stream exactly what they would have streamed anyway."""
    r = redis.Redis.from_url(redis_url)
    names = Names()
    procs = []

    crashing = (str(ROOT / "tests" / "crashing_worker.py"),)

    def start(name):
        procs.append(worker_process(llama_ckpt, redis_url, "--consumer", name, "--claim-idle", "1.0",
                                    log_path=tmp_path / f"{name}.log", program=crashing))
        return procs[-1]

    try:
        first = start("w-1")
        await wait_for(lambda: len(r.keys(names.worker("*"))) == 1, timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            ids = [await client.submit(p, params=GOOD) for p in PROMPTS[:2]]
            await client.submit("the poison", id="poison", params=GOOD)
            ids.append(await client.submit(PROMPTS[2], params=GOOD))
        await wait_for(lambda: exited(first), timeout=30)
        second = start("w-2")
        await wait_for(lambda: exited(second), timeout=60)  # the poison's lone attempt
        third = start("w-3")
        await wait_for(lambda: all(read_events(redis_url, i) and read_events(redis_url, i)[-1]["type"] != "token"
                                   for i in [*ids, "poison"]), timeout=90)
        await wait_for(lambda: r.xlen(names.requests) == 0, timeout=10)
        assert not exited(third)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [p.returncode for p in procs[:2]] == [86, 86]
    assert "running it alone" in (tmp_path / "w-2.log").read_text()
    expected = offline_tokens(llama_ckpt, PROMPTS, SamplingParams(**GOOD))
    for request_id, tokens in zip(ids, expected, strict=True):
        events = read_events(redis_url, request_id)
        assert check_complete(events)["type"] == "done" and tokens_of(events) == tokens
    poison = read_events(redis_url, "poison")
    assert [(e["type"], e.get("code")) for e in poison] == [("error", "crashed_worker")]
    assert [d["reason"] for d in dead_letters(redis_url)] == [b"crashed_worker"]
    r.close()
