"""Graceful drain (workers/worker/handoff.py): SIGTERM to one of two workers in the middle of 20
streams. It stops reading, gives its jobs the drain timeout, hands what is unfinished back to the
queue and exits 0 within the timeout; the other worker takes those jobs at once (long before its
--claim-idle would let it) and resumes each from its last event: every stream is the greedy
generation of an uninterrupted run, token for token, with one `done`."""

import signal
import time

import anyio
import pytest
import redis
from redis_worker_helpers import (
    check_complete,
    long_context_checkpoint,
    read_events,
    tokens_of,
    wait_for,
    worker_process,
)

from clients.protocol import Names
from clients.redis_client import AsyncClient
from streamer import LLM, SamplingParams

NAMES = Names()
JOBS = 20
MAX_TOKENS = 300
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
CLAIM_IDLE_S = 120.0  # far past the test's wait: only a hand-off can move a job in time
DRAIN_S = 0.1


def pending_of(r: redis.Redis, consumer: str) -> list:
    return r.xpending_range(NAMES.requests, NAMES.group, "-", "+", 100, consumername=consumer)


@pytest.mark.anyio
async def test_a_drained_worker_hands_its_jobs_to_another_that_finishes_them_identically(redis_url, tmp_path):
    ckpt = long_context_checkpoint(tmp_path / "ckpt")
    r = redis.Redis.from_url(redis_url)
    args = ("--claim-idle", str(CLAIM_IDLE_S), "--drain-timeout", str(DRAIN_S))
    a = worker_process(ckpt, redis_url, "--consumer", "w-a", *args, log_path=tmp_path / "a.log")
    b = worker_process(ckpt, redis_url, "--consumer", "w-b", *args, log_path=tmp_path / "b.log")
    prompts = [[11 + i, 40 + 3 * i, 77, 5 + i] * 5 for i in range(JOBS)]
    try:
        await wait_for(lambda: len(r.keys(NAMES.worker("*"))) == 2, timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            ids = [await client.submit(prompt_token_ids=p, params=GREEDY) for p in prompts]
        await wait_for(lambda: len(pending_of(r, "w-a")) >= 3 and all(len(read_events(redis_url, i)) >= 3 for i in ids),
                       timeout=60, interval=0.01)
        held = {e["message_id"] for e in pending_of(r, "w-a")}
        sent = time.monotonic()
        a.send_signal(signal.SIGTERM)
        with anyio.fail_after(DRAIN_S + 15):
            while a.poll() is None:
                await anyio.sleep(0.05)
        drained_in = time.monotonic() - sent
        assert a.returncode == 0
        await wait_for(lambda: all(read_events(redis_url, i)[-1]["type"] == "done" for i in ids), timeout=90)
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()
    log_a = (tmp_path / "a.log").read_text()
    assert "handed" in log_a and "back to the queue" in log_a, log_a[-2000:]
    assert drained_in < DRAIN_S + 10  # the drain timeout, the last writes, leaving: no claim-idle wait
    assert held, "worker A held no job when it was stopped: the test shows nothing"
    assert r.xlen(NAMES.requests) == 0 and not pending_of(r, "w-a") and not pending_of(r, "w-b")
    with LLM(str(ckpt), dtype="float32", num_kv_blocks=1024) as llm:  # uninterrupted, in one process
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY))
    want = [o.outputs[0].token_ids for o in outs]
    for request_id, expected in zip(ids, want, strict=True):
        events = read_events(redis_url, request_id)
        check_complete(events)  # seqs once each, one terminal event, last
        assert tokens_of(events) == expected, request_id
    r.close()
