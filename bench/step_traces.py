"""Cost of step records and slow-step tracing, as a share of the engine's step time, in one run.

    python -m bench.step_traces [--requests 32] [--cache-dir DIR]

Runs a workload on the 110M random Llama and times (1) its steps, (2) what the engine spends per step
building its StepRecord and the request stage times (the same calls, timed on their own on a batch
of the same size after each step), and (3) what the worker's slow-step monitor
(workers/worker/steps.py) spends per record with a full window. Prints each cost per step and as a
percentage of the mean step time (the issue's bar: under 1%).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness.machine import CACHE_DIR
from bench.harness.workload import bench_checkpoint, make_workload, submit_greedy
from streamer import LLMEngine
from streamer.config import EngineConfig
from streamer.llm_engine import _mark_outputs
from streamer.outputs import StepRecord
from streamer.scheduler_output import ScheduledSeq, SchedulerOutput
from workers.worker.steps import WINDOW, SlowSteps, TraceConfig


def step_times(engine: LLMEngine) -> tuple[list[float], float]:
    """Wall time of each step, and the time of its step-record bookkeeping done again on its own
    (the same calls step() makes, on a batch of the same size: the running sequences)."""
    times, bookkeeping = [], 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        batch = SchedulerOutput()
        batch.scheduled = [ScheduledSeq(seq, 1) for seq in engine.scheduler.running]
        b0 = time.perf_counter()
        now = time.monotonic()
        engine._mark_scheduled(batch, now)
        counts = batch.num_tokens, batch.num_prompt_tokens
        StepRecord(0, now, len(batch.scheduled), *counts, schedule_s=0.0, execute_s=0.0, process_s=0.0)
        _mark_outputs(outputs, time.monotonic())
        bookkeeping += time.perf_counter() - b0
    return times, bookkeeping


def monitor_cost(records: list[StepRecord], batch: int) -> float:
    """Seconds per record of SlowSteps.observe with a full window, in batches as the worker looks."""
    slow = SlowSteps(TraceConfig(), "bench")
    slow.observe(records[:WINDOW])
    start = time.perf_counter()
    for i in range(0, len(records), batch):
        slow.observe(records[i:i + batch])
    return (time.perf_counter() - start) / len(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=str(bench_checkpoint(args.cache_dir)), dtype="float32"))
    work = make_workload(args.requests, 32000, mean_prompt=100, min_out=32, max_out=128, seed=0)
    submit_greedy(engine, work)
    times, bookkeeping = step_times(engine)
    records = engine.take_step_records()
    mean_step = sum(times) / len(times)
    per_step = bookkeeping / len(times)
    batch = max(1, int(0.25 / mean_step))  # the steps one 0.25 s look of the monitor takes
    many = (records * (1 + 3 * WINDOW // len(records)))[: 3 * WINDOW]
    monitor = monitor_cost(many, batch)
    result = {"steps": len(times), "mean_step_ms": round(mean_step * 1e3, 3),
              "engine_bookkeeping_us": round(per_step * 1e6, 2),
              "engine_bookkeeping_pct": round(100 * per_step / mean_step, 4),
              "monitor_per_step_us": round(monitor * 1e6, 2),
              "monitor_pct": round(100 * monitor / mean_step, 4)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
