"""OpenTelemetry traces of the gateway and the worker, on when the standard OTel environment says so.

`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns tracing on; the OTLP/HTTP
exporter reads the rest of the standard variables itself (headers, timeout, `OTEL_SERVICE_NAME`,
`OTEL_BSP_*` for batching). `OTEL_SDK_DISABLED=true` keeps it off. Off, `tracer()` is None and nothing
of OpenTelemetry is imported: the callers' only cost is that test.

A trace crosses Redis inside the job: the gateway starts a request span and writes its W3C
`traceparent` into the job (clients/protocol.py), and whichever worker runs the job (the first, or one
that takes it over after a crash) opens its spans under it, so one request is one trace.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("streamer.tracing")
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_tracer: Any = None
_configured = False


def enabled() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(os.environ.get(name) for name in _ENDPOINT_VARS)


def tracer(service: str) -> Any:
    """This process's tracer (the first caller names the service), or None when tracing is off."""
    global _tracer, _configured
    if not _configured:
        _configured = True
        if enabled():
            _tracer = _start(service)
    return _tracer


def _start(service: str) -> Any:
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        log.warning("%s is set but OpenTelemetry is not installed: pip install 'streamer[otel]'; no traces",
                    next(name for name in _ENDPOINT_VARS if os.environ.get(name)))
        return None
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, wins over this default (Resource.create reads it).
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return trace.get_tracer("streamer")


def flush() -> None:
    """Export what is buffered (a worker shutting down: its last spans are not lost)."""
    if _tracer is not None:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush(5_000)


def context_of(traceparent: str) -> Any:
    """The OTel context a job's `traceparent` names (None: a new trace)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(span: Any) -> str:
    """The W3C `traceparent` naming `span`, to write into a job."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def ns(unix_s: float) -> int:
    """A span time from a wall-clock time in seconds (OTel's times are nanoseconds since the epoch)."""
    return int(unix_s * 1e9)


def now_ns() -> int:
    return time.time_ns()
