"""The spans of one job on this worker, under the trace its `traceparent` names (workers/tracing.py):

    gateway.request (the gateway's)
    ├── queue.wait          pushed to the stream -> read by this worker (first delivery only)
    └── worker.job          read -> its last event in Redis; a takeover is a second worker.job
        ├── worker.admission    read -> handed to the engine (prompt, tools, room in the engine)
        ├── prefill             handed to the engine -> its first output
        ├── decode              first output -> finished (token counts, time to first token)
        └── events.write        the final events queued -> written to Redis

With tracing off every job gets NO_TRACE, whose methods do nothing: no span, no clock read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from clients.protocol import Job
from workers import tracing


class NoTrace:
    def prefill(self) -> None: ...

    def decoding(self) -> None: ...

    def finished(self, usage: dict[str, int], finish_reasons: list[str]) -> None: ...

    def failed(self, code: str) -> None: ...

    def final_write(self) -> Callable[[], None] | None:
        return None

    def end(self) -> None: ...


NO_TRACE = NoTrace()


def start(job: Job, entry_id: str, deliveries: int, consumer: str, next_seq: int) -> NoTrace:
    """The trace of a job this worker just read (NO_TRACE when tracing is off); `next_seq`: the events
    an earlier worker already wrote (a takeover resumes after them)."""
    tracer = tracing.tracer("streamer-worker")
    return NO_TRACE if tracer is None else JobTrace(tracer, job, entry_id, deliveries, consumer, next_seq)


def _entry_time_ns(entry_id: str) -> int | None:
    """When the entry was added: its stream id is `<unix ms>-<n>` (Redis's clock)."""
    ms = entry_id.split("-", 1)[0]
    return int(ms) * 1_000_000 if ms.isdigit() else None


class JobTrace(NoTrace):
    def __init__(self, tracer: Any, job: Job, entry_id: str, deliveries: int, consumer: str, next_seq: int) -> None:
        from opentelemetry import trace

        self.tracer, self._trace = tracer, trace
        parent = tracing.context_of(job.traceparent)
        now = time.time_ns()
        pushed = _entry_time_ns(entry_id)
        if deliveries == 1 and pushed is not None and pushed <= now:
            tracer.start_span("queue.wait", context=parent, start_time=pushed,
                              attributes={"streamer.request_id": job.id}).end(end_time=now)
        self.job_span = tracer.start_span("worker.job", context=parent, start_time=now, attributes={
            "streamer.request_id": job.id, "streamer.worker": consumer, "streamer.deliveries": deliveries,
            "streamer.takeover": deliveries > 1, "streamer.entry_id": entry_id, "streamer.resumed_at_seq": next_seq})
        self._inside = trace.set_span_in_context(self.job_span)
        self._phase: Any = tracer.start_span("worker.admission", context=self._inside, start_time=now)
        self._decode_start = 0
        self._writing = False
        self._ended = False

    def _next_phase(self, name: str) -> Any:
        now = time.time_ns()
        if self._phase is not None:
            self._phase.end(end_time=now)
        self._phase = self.tracer.start_span(name, context=self._inside, start_time=now)
        return now

    def prefill(self) -> None:
        self._next_phase("prefill")

    def decoding(self) -> None:
        self._decode_start = self._next_phase("decode")
        self.job_span.set_attribute("streamer.ttft_ms", (self._decode_start - self.job_span.start_time) / 1e6)

    def finished(self, usage: dict[str, int], finish_reasons: list[str]) -> None:
        span = self._phase if self._decode_start else self.job_span
        span.set_attributes({"gen_ai.usage.input_tokens": usage["prompt_tokens"],
                             "gen_ai.usage.output_tokens": usage["completion_tokens"],
                             "streamer.cached_tokens": usage["cached_tokens"],
                             "gen_ai.response.finish_reasons": finish_reasons})

    def failed(self, code: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.job_span.set_status(Status(StatusCode.ERROR, code))
        self.job_span.set_attribute("streamer.error", code)

    def final_write(self) -> Callable[[], None]:
        """Opens `events.write`; the returned function ends it, and the job's span, once written."""
        self._close_phase()
        span = self.tracer.start_span("events.write", context=self._inside)
        self._writing = True

        def written() -> None:
            span.end()
            self.job_span.end()

        return written

    def _close_phase(self) -> None:
        if self._phase is not None:
            self._phase.end()
            self._phase = None

    def end(self) -> None:
        """The delivery's task ended: whatever is still open ends now, but the job's span waits for a
        final write under way (its callback ends it)."""
        if self._ended:
            return
        self._ended = True
        self._close_phase()
        if not self._writing:
            self.job_span.end()
