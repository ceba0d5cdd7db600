"""What tracing costs a job on the worker: the per-job span work of workers/worker/job_trace.py with
tracing off (the default: one check and no-op calls) against on (real SDK spans, batched to an
exporter that drops them), side by side in one run. Per job, not per token: no span is made per token.

    python -m bench.tracing_overhead [--jobs 20000]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from clients.protocol import Job
from workers import tracing
from workers.worker import job_trace


def one_job(trace: job_trace.NoTrace) -> None:
    """The calls a served job makes on its trace, in order (job.py, answers.py)."""
    trace.prefill()
    trace.decoding()
    trace.finished({"prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 0}, ["length"])
    written = trace.final_write()
    trace.end()
    if written is not None:
        written()


def per_job_us(start: Callable[[Job], job_trace.NoTrace], jobs: int) -> float:
    job = Job(id="bench", encoding="json", prompt="x", traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
    t0 = time.perf_counter()
    for _ in range(jobs):
        one_job(start(job))
    return (time.perf_counter() - t0) / jobs * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    args = ap.parse_args()
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)

    def off(job: Job) -> job_trace.NoTrace:
        return job_trace.start(job, "1700000000000-0", 1, "w", 0)

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracer = provider.get_tracer("bench")

    def on(job: Job) -> job_trace.NoTrace:
        return job_trace.JobTrace(tracer, job, "1700000000000-0", 1, "w", 0)

    assert tracing.tracer("bench") is None  # off: the path every job takes by default
    rows = [("off", per_job_us(off, args.jobs)), ("on", per_job_us(on, max(1, args.jobs // 10)))]
    print("| tracing | per job (µs) |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    provider.shutdown()


if __name__ == "__main__":
    main()
