"""Slow-step traces (workers/worker/steps.py): a step much slower than the recent normal is written
once, with the steps before it, to llm:traces; normal steps never are."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis_worker_helpers import running_worker, wait_for

from clients.names import Names
from clients.redis_client import AsyncClient
from streamer.outputs import StepRecord
from workers.worker.steps import RING, SlowSteps, TraceConfig, slow_step_line


def record(i: int, execute_s: float) -> StepRecord:
    return StepRecord(i, 1000.0 + i, 4, 4, 0, schedule_s=0.0001, execute_s=execute_s, process_s=0.0002)


def test_only_a_step_over_the_threshold_is_traced() -> None:
    slow = SlowSteps(TraceConfig(factor=3.0, floor_s=0.02, min_steps=50), "w1")
    normal = [record(i, 0.010 + 0.001 * (i % 5)) for i in range(1, 200)]  # p99 ~ 0.0143
    assert slow.observe(normal) == []
    assert slow.observe([record(200, 0.040)]) == []  # 2.8x: not slow enough
    traces = slow.observe([record(201, 0.060), record(202, 0.011)])
    assert len(traces) == 1
    t = traces[0]
    assert (t["worker"], t["step"]) == ("w1", 201) and t["total_s"] == pytest.approx(0.0603)
    assert t["threshold_s"] == pytest.approx(3 * slow_p99_before(normal + [record(200, 0.040)]), rel=1e-6)
    assert [s["index"] for s in t["steps"]] == list(range(201 - RING + 1, 202))  # the slow one, last
    assert t["breakdown"]["execute_s"] == pytest.approx(0.06) and t["breakdown"]["event_write_s"] == 0


def slow_p99_before(records: list[StepRecord]) -> float:
    totals = sorted(r.total_s for r in records)
    return totals[min(len(totals) - 1, int(0.99 * len(totals)))]


def test_the_log_gets_one_short_line_per_slow_step() -> None:
    """A terminal running `streamer up` shows the warning: one line naming the step, its time, what
    it held, where the time went and where the whole trace is, not the trace's JSON."""
    slow = SlowSteps(TraceConfig(factor=3.0, floor_s=0.02, min_steps=50), "w1")
    slow.observe([record(i, 0.010) for i in range(1, 200)])
    prefill = StepRecord(200, 1200.0, 18, 2048, 2042, schedule_s=0.001, execute_s=3.5, process_s=0.002)
    (trace,) = slow.observe([prefill])
    line = slow_step_line(trace, "llm:traces")
    assert "\n" not in line and len(line) < 240, line
    assert line.startswith("slow step 200: 3.50 s (p99 0.01 s), 2048 tokens of 18 sequences (2042 of prompts)")
    assert "most in execute 3.50 s" in line  # no phases recorded (a tensor-parallel executor): the whole
    phased = {**trace, "breakdown": {**trace["breakdown"], "prepare_s": 0.1, "forward_s": 3.3, "sample_s": 0.1}}
    assert "most in forward 3.30 s" in slow_step_line(phased, "llm:traces")
    assert line.endswith("trace in llm:traces (streamer top)")


def test_nothing_is_slow_before_the_normal_is_known_nor_under_the_floor() -> None:
    slow = SlowSteps(TraceConfig(factor=3.0, floor_s=0.05, min_steps=100), "w1")
    assert slow.observe([record(i, 0.001) for i in range(1, 99)] + [record(99, 1.0)]) == []  # too few steps
    assert slow.observe([record(i, 0.001) for i in range(100, 300)]) == []
    assert slow.observe([record(300, 0.04)]) == []  # 40x the normal, but under the 50 ms floor


@pytest.mark.anyio
async def test_an_injected_stall_gives_exactly_one_trace(llama_ckpt: Path, redis_url: str) -> None:
    names = Names()
    r = aioredis.Redis.from_url(redis_url)
    cfg = TraceConfig(every_s=0.05, factor=3.0, floor_s=0.05, min_steps=30)
    async with running_worker(llama_ckpt, redis_url, traces=cfg) as worker, AsyncClient(redis_url) as client:
        params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        await client.generate("warm up the normal", params=params)
        await wait_for(lambda: len(worker.steps.slow.window) >= 30, timeout=10)
        assert await r.xlen(names.traces) == 0  # normal steps: no trace
        runner = worker.engine.engine.executor
        real, stalled = runner.execute, []

        def stall_once(*args, **kwargs):
            if not stalled:
                stalled.append(True)
                time.sleep(0.4)
            return real(*args, **kwargs)

        runner.execute = stall_once
        try:
            await client.generate("one stall in the middle", params=params)
        finally:
            runner.execute = real
        await client.generate("and normal again", params=params)
        await wait_for(lambda: worker.steps.traces_written >= 1, timeout=10)
        entries = await r.xrange(names.traces)
    await r.aclose()
    assert len(entries) == 1
    trace = json.loads(entries[0][1][b"json"])
    assert trace["worker"] == worker.cfg.consumer and trace["total_s"] >= 0.4
    parts = trace["breakdown"]
    assert parts["execute_s"] >= 0.4 and trace["steps"][-1]["index"] == trace["step"]
    # Split up by the runner: the stall was before its phases (in execute, not in them).
    assert parts["prepare_s"] + parts["forward_s"] + parts["sample_s"] < parts["execute_s"] - 0.3
    assert parts["event_write_s"] >= 0
    assert abs(trace["at_ms"] / 1000 - time.time()) < 30
