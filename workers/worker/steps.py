"""The engine's step records, read by the worker: handed to the metrics, and kept in a ring buffer so
that a rare stall explains itself.

Every `every_s` the monitor takes the steps the engine ran since its last look (`take_step_records`)
and gives them to its sinks (the Prometheus metrics). It keeps the last RING of them; a step much
slower than the recent normal (over `trace_factor` x the p99 of the last WINDOW steps, and over
`trace_floor_s`) is written with the steps leading up to it as one JSON entry to the capped stream
`llm:traces` and as one log line. Nothing is traced while the window is too short to know what is
normal. Costs a deque append and a comparison per step, and one sort of WINDOW floats per look.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import anyio
from redis.asyncio import Redis

from clients.backoff import TRANSIENT
from clients.names import Names
from streamer.outputs import StepRecord
from workers.worker.engine import Engine

log = logging.getLogger("streamer.worker")

RING = 32  # steps kept for a trace: the slow one and those before it
WINDOW = 1000  # steps the normal (p99) is taken over
TRACES_MAX_LEN = 1000  # entries kept in llm:traces (about: trimmed with ~)

StepSink = Callable[[list[StepRecord]], None]


@dataclass(frozen=True)
class TraceConfig:
    every_s: float = 0.25
    factor: float = 3.0
    floor_s: float = 0.05  # a step faster than this is never a stall worth a trace
    min_steps: int = 100  # steps seen before anything counts as slow


class SlowSteps:
    """Pure part: step records in, trace records (dicts) out."""

    def __init__(self, cfg: TraceConfig, worker: str) -> None:
        self.cfg, self.worker = cfg, worker
        self.ring: deque[StepRecord] = deque(maxlen=RING)
        self.window: deque[float] = deque(maxlen=WINDOW)
        # Wall clock of the monotonic clock's zero: traces carry times anyone can read.
        self._wall_offset = time.time() - time.monotonic()

    def p99(self) -> float:
        ordered = sorted(self.window)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0

    def observe(self, records: list[StepRecord], event_write_s: float = 0.0) -> list[dict[str, Any]]:
        traces = []
        threshold = self._threshold()
        for r in records:
            self.ring.append(r)
            if threshold is not None and r.total_s > threshold:
                traces.append(self._trace(r, threshold, event_write_s))
            self.window.append(r.total_s)
        return traces

    def _threshold(self) -> float | None:
        if len(self.window) < self.cfg.min_steps:
            return None
        return max(self.cfg.floor_s, self.cfg.factor * self.p99())

    def _trace(self, slow: StepRecord, threshold: float, event_write_s: float) -> dict[str, Any]:
        return {"worker": self.worker, "step": slow.index, "at_ms": int((slow.started + self._wall_offset) * 1000),
                "total_s": round(slow.total_s, 6), "threshold_s": round(threshold, 6),
                "p99_s": round(self.p99(), 6), "breakdown": _breakdown(slow, event_write_s),
                "steps": [{**asdict(r), "total_s": r.total_s} for r in self.ring]}


class StepMonitor:
    def __init__(self, redis: Redis, names: Names, engine: Engine, worker: str, cfg: TraceConfig,
                 sinks: list[StepSink], event_writes: Callable[[], float] = lambda: 0.0) -> None:
        """`event_writes()`: the slowest event-write round trip since the last call."""
        self.redis, self.names, self.engine, self.cfg, self.sinks = redis, names, engine, cfg, sinks
        self.event_writes = event_writes
        self.slow = SlowSteps(cfg, worker)
        self.traces_written = 0

    async def loop(self) -> None:
        while True:
            await anyio.sleep(self.cfg.every_s)
            await self.look()

    async def look(self) -> None:
        records = self.engine.take_step_records()
        if not records:
            return
        for sink in self.sinks:
            sink(records)
        for trace in self.slow.observe(records, self.event_writes()):
            text = json.dumps(trace, separators=(",", ":"))
            log.warning("%s", slow_step_line(trace, self.names.traces))
            try:
                await self.redis.xadd(self.names.traces, {"json": text}, maxlen=TRACES_MAX_LEN, approximate=True)
                self.traces_written += 1
            except TRANSIENT as e:  # then the log has the whole trace, at debug level
                log.debug("slow-step trace not written to Redis (%r): %s", e, text)


def slow_step_line(trace: dict[str, Any], stream: str) -> str:
    """One short line for the log (a terminal running `streamer up` shows it): the whole trace, with
    the steps around it, is in Redis for `streamer top`."""
    step = trace["steps"][-1] if trace["steps"] else {}
    parts = trace["breakdown"]
    split = "forward_s" in parts  # execute_s split into its phases: name the phase
    slowest = max((k for k in parts if not (split and k == "execute_s")), key=lambda k: parts[k])
    return (f"slow step {trace['step']}: {trace['total_s']:.2f} s (p99 {trace['p99_s']:.2f} s), "
            f"{step.get('num_tokens', '?')} tokens of {step.get('num_seqs', '?')} sequences "
            f"({step.get('num_prefill_tokens', '?')} of prompts), most in {slowest.removesuffix('_s')} "
            f"{parts[slowest]:.2f} s; trace in {stream} (streamer top)")


def _breakdown(r: StepRecord, event_write_s: float) -> dict[str, float]:
    parts = {"schedule_s": r.schedule_s, "execute_s": r.execute_s, "process_s": r.process_s}
    if r.phases is not None:
        parts.update(prepare_s=r.phases.prepare_s, forward_s=r.phases.forward_s, sample_s=r.phases.sample_s)
    # Event writes run beside the steps, not in them: the slowest round trip of the look that saw it.
    parts["event_write_s"] = event_write_s
    return {k: round(v, 6) for k, v in parts.items()}
