"""OpenTelemetry traces across processes: a real gateway and real workers (child processes) export
through the OTLP/HTTP exporter to a receiver started here, which decodes what they really send with
`opentelemetry-proto`. One request is one trace, from the client's span through the gateway, the
queue and the worker; a job taken over after its worker was SIGKILLed goes on in the same trace."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from redis_worker_helpers import ROOT, kill_all, wait_for, worker_process

from clients.protocol import Names
from workers import tracing
from workers.redis_server import free_port

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver (protobuf, `POST /v1/traces`) keeping every span it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def keep(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(Span(attrs.get("service.name", ""), s.name, s.trace_id.hex(),
                                               s.span_id.hex(), s.parent_span_id.hex(),
                                               {a.key: _value(a.value) for a in s.attributes}))

    def of_request(self, rid: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.attributes.get("streamer.request_id") == rid]


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        assert self.path == "/v1/traces", self.path
        self.server.keep(body)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # The child processes inherit these: the standard variables, nothing of our own.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", server.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def gateway_process(redis_url: str, port: int, log_path: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "workers.cli", "gateway", "--redis", redis_url, "--port", str(port)]
    with open(log_path, "wb") as out:
        return subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def complete(port: int, model: Path, rid: str, max_tokens: int, traceparent: str | None = None) -> dict[str, Any]:
    headers = {"X-Request-Id": rid} | ({"traceparent": traceparent} if traceparent else {})
    body = {"model": str(model), "prompt": "the paged cache", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


async def spans_of(receiver: Receiver, rid: str, names: set[str], timeout: float) -> dict[str, list[Span]]:
    def have() -> bool:
        return names <= {s.name for s in receiver.of_request(rid)} | _children_names(receiver, rid)

    await wait_for(have, timeout=timeout, interval=0.1)
    by_name: dict[str, list[Span]] = {}
    for s in _request_tree(receiver, rid):
        by_name.setdefault(s.name, []).append(s)
    return by_name


def _request_tree(receiver: Receiver, rid: str) -> list[Span]:
    """The request's spans: those naming it, and the phases under its worker.job spans."""
    own = receiver.of_request(rid)
    jobs = {s.span_id for s in own if s.name == "worker.job"}
    with receiver.lock:
        return own + [s for s in receiver.spans if s.parent in jobs]


def _children_names(receiver: Receiver, rid: str) -> set[str]:
    return {s.name for s in _request_tree(receiver, rid)}


PHASES = {"worker.admission", "prefill", "decode", "events.write"}


def _the(spans: dict[str, list[Span]], name: str) -> Span:
    (span,) = spans[name]
    return span


@pytest.mark.anyio
async def test_one_request_is_one_trace_across_the_gateway_the_queue_and_the_worker(
        llama_ckpt: Path, redis_url: str, receiver: Receiver, tmp_path: Path) -> None:
    port = free_port()
    procs = {"gateway": gateway_process(redis_url, port, tmp_path / "gateway.log"),
             "worker": worker_process(llama_ckpt, redis_url, log_path=tmp_path / "worker.log")}
    try:
        await wait_for(lambda: _ready(port), timeout=90, interval=0.2)
        traced = complete(port, llama_ckpt, "traced", 6, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        fresh = complete(port, llama_ckpt, "fresh", 4)
        assert traced["usage"]["completion_tokens"] == 6 and fresh["usage"]["completion_tokens"] == 4
        want = {"gateway.request", "queue.wait", "worker.job"} | PHASES
        for rid, tokens in (("traced", 6), ("fresh", 4)):
            spans = await spans_of(receiver, rid, want, timeout=30)
            gateway, job = _the(spans, "gateway.request"), _the(spans, "worker.job")
            assert len({s.trace_id for group in spans.values() for s in group}) == 1, spans
            assert (gateway.service, job.service) == ("streamer-gateway", "streamer-worker")
            # Parent links across two processes and Redis: gateway -> queue and worker -> its phases.
            assert _the(spans, "queue.wait").parent == gateway.span_id
            assert job.parent == gateway.span_id and job.attributes["streamer.takeover"] is False
            assert job.attributes["streamer.resumed_at_seq"] == 0
            assert all(_the(spans, name).parent == job.span_id for name in PHASES)
            decode = _the(spans, "decode")
            assert decode.attributes["gen_ai.usage.output_tokens"] == tokens
            assert decode.attributes["gen_ai.usage.input_tokens"] > 0
            assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
            assert job.attributes["streamer.ttft_ms"] > 0
            if rid == "traced":  # under the client's own span, in the client's trace
                assert (gateway.trace_id, gateway.parent) == (CLIENT_TRACE, CLIENT_SPAN)
            else:
                assert gateway.trace_id != CLIENT_TRACE and gateway.parent == ""
    finally:
        kill_all(procs)


@pytest.mark.anyio
async def test_a_job_taken_over_after_its_worker_was_killed_goes_on_in_the_same_trace(
        llama_ckpt: Path, redis_url: str, receiver: Receiver, tmp_path: Path) -> None:
    port = free_port()
    r = redis.Redis.from_url(redis_url)
    names = Names()
    takeover = ("--claim-idle", "1.5", "--grace", "5")
    procs = {"gateway": gateway_process(redis_url, port, tmp_path / "gateway.log"),
             "w-a": worker_process(llama_ckpt, redis_url, "--consumer", "w-a", *takeover,
                                   log_path=tmp_path / "w-a.log")}
    try:
        await wait_for(lambda: _ready(port), timeout=90, interval=0.2)
        answer: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: answer.update(complete(port, llama_ckpt, "long", 300,
                                                                        f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")))
        thread.start()
        # Killed mid-generation: some of its events are written, the rest must come from another worker.
        await wait_for(lambda: r.xlen(names.events("long")) >= 20, timeout=60, interval=0.05)
        procs["w-a"].kill()
        procs["w-a"].wait()
        procs["w-b"] = worker_process(llama_ckpt, redis_url, "--consumer", "w-b", *takeover,
                                      log_path=tmp_path / "w-b.log")
        await wait_for(lambda: not thread.is_alive(), timeout=180, interval=0.2)
        assert answer["usage"]["completion_tokens"] == 300, answer
        await wait_for(lambda: any(s.name == "worker.job" and s.attributes["streamer.takeover"]
                                   for s in receiver.of_request("long")), timeout=30, interval=0.1)
        spans = await spans_of(receiver, "long", {"gateway.request", "worker.job"} | PHASES, timeout=30)
        gateway = _the(spans, "gateway.request")
        # w-a died before exporting its spans (SIGKILL): what is left is w-b's, still under the gateway.
        (job,) = [s for s in spans["worker.job"] if s.attributes["streamer.takeover"]]
        assert (job.attributes["streamer.worker"], job.attributes["streamer.deliveries"]) == ("w-b", 2)
        assert job.trace_id == gateway.trace_id == CLIENT_TRACE and job.parent == gateway.span_id
        # It resumed after the events w-a wrote; its usage counts the whole answer, as the client's does.
        assert job.attributes["streamer.resumed_at_seq"] >= 20
        assert _the(spans, "decode").attributes["gen_ai.usage.output_tokens"] == 300
    finally:
        kill_all(procs)
        r.close()


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_tracing_is_off_unless_the_standard_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.enabled()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    assert tracing.enabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.enabled()


def test_a_traceparent_names_the_span_it_came_from() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    span = tracer.start_span("child", context=tracing.context_of(parent))
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    assert tracing.traceparent_of(span).startswith(f"00-{CLIENT_TRACE}-")
    assert tracing.context_of("") is None
    span.end()
    assert time.time_ns() >= span.end_time
