"""Where a job is before its first token (issue: long prompts must not look stuck): the engine's
prompt progress, the worker's `progress:{id}` values, the queue place from the stream's counters,
and the gateway's opt-in `status` / `resumed` frames, with a real worker, gateway and Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis_worker_helpers import long_context_checkpoint, running_worker
from test_gateway import NAMES, collect, config, done, emit, recv, send, tokens
from websockets.asyncio.client import connect

from clients.protocol import encode_job
from streamer import EngineConfig, LLMEngine, SamplingParams
from workers.gateway.server import running_gateway


def test_engine_reports_prompt_progress_chunk_by_chunk(llama_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=16))
    engine.add_request("long", {"prompt_token_ids": list(range(3, 103))}, SamplingParams(max_tokens=2))
    first = engine.prompt_progress()["long"]
    assert (first.computed_tokens, first.prompt_tokens, first.scheduled) == (0, 100, False)
    seen = []
    while "long" in engine.prompt_progress() or not seen:
        engine.step()
        p = engine.prompt_progress().get("long")
        seen.append(None if p is None else (p.computed_tokens, p.scheduled))
    assert seen[:-1] == [(16 * i, True) for i in range(1, 7)]  # 16 tokens a step, then past the prompt
    assert seen[-1] is None and len(seen) == 7


async def _statuses_until_token(ws, rid: str, timeout: float = 60) -> list[dict]:
    statuses = []
    while True:
        frame = await recv(ws, timeout)
        if frame.get("id") != rid or frame["type"] == "accepted":
            continue
        if frame["type"] != "status":
            assert frame["type"] == "token", frame
            return statuses
        statuses.append(frame)


PROMPT = 8000


@pytest.mark.anyio
async def test_a_long_prompt_reports_its_progress_then_streams(tmp_path: Path, redis_url: str) -> None:
    ckpt = long_context_checkpoint(tmp_path / "long")
    # 1,000 8-token chunks: per-step costs dominate (16-token chunks took only ~0.15 s with the
    # compiled kernels: two reports at 0.05 s failed a fresh-clone CI); progress polled every 10 ms.
    prompt = [3 + (i * 7) % 500 for i in range(PROMPT)]
    async with running_worker(ckpt, redis_url, engine={"max_num_batched_tokens": 8, "num_kv_blocks": 520},
                              progress_every_s=0.01), \
            running_gateway(config(redis_url, status_every_s=0.01)) as gw, connect(gw.ws_url) as ws:
        await send(ws, {"type": "generate", "id": "p1", "prompt_token_ids": prompt, "progress": True,
                        "params": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}})
        statuses = await _statuses_until_token(ws, "p1")
        rest = (await collect(ws, {"p1"}))["p1"]
    prefill = [s for s in statuses if s["state"] == "prefill"]
    assert len(prefill) >= 3, statuses  # chunks reported as they go
    assert all(s["total"] == PROMPT and 0 <= s["computed"] < PROMPT and s["worker"] for s in prefill)
    computed = [s["computed"] for s in prefill]
    assert computed == sorted(computed) and computed[-1] > computed[0]
    assert {s["state"] for s in statuses} <= {"queued", "starting", "waiting", "prefill"}
    assert rest[-1]["type"] == "done" and rest[-1]["usage"]["prompt_tokens"] == PROMPT


@pytest.mark.anyio
async def test_queued_jobs_learn_their_place_and_only_when_they_ask(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url, status_every_s=0.1)) as gw, connect(gw.ws_url) as ws:
        for i in range(3):
            await send(ws, {"type": "generate", "id": f"q{i}", "prompt": "x", "progress": True})
        await send(ws, {"type": "generate", "id": "quiet", "prompt": "x"})
        latest: dict[str, dict] = {}
        counts: dict[str, int] = {}
        others = []

        async def until(check) -> None:
            while not check():
                frame = await recv(ws)
                if frame["type"] == "status":
                    latest[frame["id"]] = frame
                    counts[frame["id"]] = counts.get(frame["id"], 0) + 1
                elif frame["type"] != "accepted":
                    others.append(frame)

        await asyncio.wait_for(until(lambda: len(latest) == 3), 10)
        assert {rid: (f["state"], f["position"]) for rid, f in latest.items()} == {
            "q0": ("queued", 0), "q1": ("queued", 1), "q2": ("queued", 2)}
        # A worker joins and reads the first job: it is starting, the others move up.
        # (The first push created the group, so that the lane is found: a worker joining finds it there.)
        assert [g["name"].decode() for g in await r.xinfo_groups(NAMES.requests)] == [NAMES.group]
        await r.xreadgroup(NAMES.group, "w1", {NAMES.requests: ">"}, count=1)
        await asyncio.wait_for(until(lambda: latest["q2"].get("position") == 1), 10)
        assert latest["q0"] == {"type": "status", "id": "q0", "state": "starting"}
        assert (latest["q1"]["state"], latest["q1"]["position"]) == ("queued", 0)
        # Its worker reports the prompt's progress: that is what the client sees next.
        await r.set(NAMES.progress("q0"), json.dumps({"state": "prefill", "computed": 64, "total": 200,
                                                      "worker": "w1"}), px=3000)
        await asyncio.wait_for(until(lambda: latest["q0"]["state"] == "prefill"), 10)
        assert latest["q0"] == {"type": "status", "id": "q0", "state": "prefill", "computed": 64, "total": 200,
                                "worker": "w1"}
        # The first event ends the statuses of that request; the others go on (when they change).
        await emit(r, "q0", tokens("q0", range(0, 1)))
        await asyncio.wait_for(until(lambda: bool(others)), 10)
        assert others[0]["type"] == "token" and others[0]["id"] == "q0"
        before = counts["q0"]
        await r.xreadgroup(NAMES.group, "w1", {NAMES.requests: ">"}, count=1)  # q1 is read now
        await asyncio.wait_for(until(lambda: latest["q1"]["state"] == "starting"), 10)
        assert counts["q0"] == before
        assert "quiet" not in latest
    await r.aclose()


@pytest.mark.anyio
async def test_resume_says_which_events_are_replayed(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw:
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": "r1", "prompt": "x"})
            await recv(ws)
        await emit(r, "r1", tokens("r1", range(0, 5)))  # written while nobody listened
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": "r1", "progress": True})
            assert await recv(ws) == {"type": "resumed", "id": "r1", "last_seq": 4}
            replayed = [await recv(ws) for _ in range(5)]
            await emit(r, "r1", tokens("r1", range(5, 7)) + [done("r1", 7)])
            live = (await collect(ws, {"r1"}))["r1"]
        assert [e["seq"] for e in replayed + live] == list(range(8))
        async with connect(gw.ws_url) as ws:  # without asking: no such frame, as before
            await send(ws, {"type": "resume", "id": "r1", "after_seq": 5})
            assert (await recv(ws))["seq"] == 6
    await r.aclose()


@pytest.mark.anyio
async def test_generate_shows_where_its_prompt_waits_on_a_terminal(tmp_path: Path, redis_url: str) -> None:
    """`streamer generate` behind a busy worker: on a terminal it says it is next in line, then its
    prompt's progress, and prints the answer after the display is gone."""
    import sys

    import anyio
    from test_progress_display import ANSI, pty_output, screen, terminal_env

    ckpt = long_context_checkpoint(tmp_path / "long")
    engine = {"max_num_seqs": 1, "max_num_batched_tokens": 16, "num_kv_blocks": 1100}
    r = aioredis.Redis.from_url(redis_url)
    async with running_worker(ckpt, redis_url, engine=engine, progress_every_s=0.05):
        # Busy for seconds (its prompt, then 1,000 tokens) whatever the machine: the CLI's start (~1 s
        # of imports) must find it still running, on a quiet fast machine too.
        await r.xadd(NAMES.requests, encode_job({"id": "busy", "prompt_token_ids": [3 + i % 400 for i in range(8000)],
                                                 "params": {"max_tokens": 1000, "ignore_eos": True}}))
        await asyncio.sleep(0.3)  # the worker has it
        # ~9,600 prompt tokens in 16-token chunks: 600 steps (0.5 s with the compiled kernels on a fast
        # machine, which a 1 s refresh missed in a fresh-clone CI), the display refreshed every 50 ms.
        argv = [sys.executable, "-m", "workers.cli", "generate", "paged attention " * 1200, "--redis", redis_url,
                "--max-tokens", "3", "--params", '{"ignore_eos": true}', "--status-interval", "0.05"]
        raw = await anyio.to_thread.run_sync(lambda: pty_output(argv, terminal_env(), timeout=90))
    await r.aclose()
    text = ANSI.sub("", raw)
    assert "queued: next in line" in text, text[-3000:]
    assert "processing the prompt" in text, text[-3000:]
    # The bar is erased before the answer: the screen ends with the answer and its summary alone.
    shown = screen(raw)
    assert shown[-1].startswith("[length; ") and "first token after" in shown[-1], shown
    assert "━" not in "".join(shown[-2:]), shown
