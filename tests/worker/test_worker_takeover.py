"""Fenced ownership: a worker paused past the claim timeout (SIGSTOP) is taken over; when it wakes
up (SIGCONT) it must not write another event. With unseeded sampling any mixing shows: the stream
must be one coherent generation, each token's reported log-prob equal to the model's log-prob of it
after exactly the tokens before it in the stream (teacher-forced), and exactly one `done`."""

import os
import signal

import anyio
import pytest
import redis
import torch
from redis_worker_helpers import check_complete, long_context_checkpoint, read_events, wait_for, worker_process
from transformers import AutoModelForCausalLM

from clients.protocol import Names
from clients.redis_client import AsyncClient

NAMES = Names()
JOBS = 10
MAX_TOKENS = 240
UNSEEDED = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}


def sampled_logprobs(events):
    """(token id, reported log-prob) of every generated token, in stream order."""
    return [(t, dict(map(tuple, lps))[t]) for e in events if e["type"] == "token"
            for t, lps in zip(e["token_ids"], e["logprobs"], strict=True)]


def teacher_forced(model, prompt, tokens):
    """The model's log-prob of each token after the prompt and every token before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logprobs[positions, torch.tensor(tokens)].tolist()


def pending_of(r, consumer):
    return r.xpending_range(NAMES.requests, NAMES.group, "-", "+", 100, consumername=consumer)


@pytest.mark.anyio
async def test_a_paused_worker_taken_over_writes_nothing_after_it_wakes(redis_url, tmp_path):
    ckpt = long_context_checkpoint(tmp_path / "ckpt")
    r = redis.Redis.from_url(redis_url)
    args = ("--claim-idle", "1.0", "--grace", "5")
    a = worker_process(ckpt, redis_url, "--consumer", "w-a", *args, log_path=tmp_path / "a.log")
    b = None
    prompts = [[11 + i, 40 + 3 * i, 77, 5 + i] * 6 for i in range(JOBS)]
    try:
        await wait_for(lambda: len(r.keys(NAMES.worker("*"))) == 1, timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            ids = [await client.submit(prompt_token_ids=p, params=UNSEEDED) for p in prompts]
        await wait_for(lambda: all(len(read_events(redis_url, i)) >= 3 for i in ids), timeout=30, interval=0.01)
        os.kill(a.pid, signal.SIGSTOP)
        assert all(read_events(redis_url, i)[-1]["type"] == "token" for i in ids), "jobs ended before the pause"
        b = worker_process(ckpt, redis_url, "--consumer", "w-b", *args, log_path=tmp_path / "b.log")
        await wait_for(lambda: len(pending_of(r, "w-b")) == JOBS, timeout=60, interval=0.01)
        os.kill(a.pid, signal.SIGCONT)  # A wakes with buffered tokens and a running engine
        await wait_for(lambda: all(read_events(redis_url, i)[-1]["type"] == "done" for i in ids), timeout=120)
        await anyio.sleep(1.0)  # anything A still had to say would land now
        assert r.xlen(NAMES.requests) == 0
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert "taken over by another worker" in (tmp_path / "a.log").read_text()

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    for request_id, prompt in zip(ids, prompts, strict=True):
        events = read_events(redis_url, request_id)
        check_complete(events)  # seqs 0..n once each, one terminal event, last
        assert [e["type"] for e in events].count("done") == 1
        pairs = sampled_logprobs(events)
        assert len(pairs) == MAX_TOKENS
        tokens, reported = [t for t, _ in pairs], [lp for _, lp in pairs]
        expected = teacher_forced(model, prompt, tokens)
        # float32 engine vs float32 transformers on the same weights: 1e-3 is far above their
        # rounding differences and far below what a token sampled after other tokens would show.
        worst = max(abs(x - y) for x, y in zip(reported, expected, strict=True))
        assert worst < 1e-3, (request_id, worst)
    r.close()
