"""The gateway's metrics on prometheus_client, served at `GET /metrics` (docs/gateway.md#metrics).

Each gateway has a registry of its own instead of the library's global one: several gateways can run
in one process (the tests do), and each must report only what it served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from clients.routing import OUTCOMES as ROUTING_OUTCOMES

PREFIX = "streamer_gateway_"

# name -> (type, help). Order here is the order on the page.
_METRICS: dict[str, tuple[str, str]] = {
    "connections_open": ("gauge", "WebSocket connections open now."),
    "connections_total": ("counter", "WebSocket connections accepted."),
    "connections_refused_total": ("counter", "Handshakes refused (bad API key or origin, too many connections)."),
    "requests_inflight": ("gauge", "Requests being relayed to an open WebSocket connection now."),
    "requests_total": ("counter", "Jobs pushed onto the requests stream."),
    "resumes_total": ("counter", "Resumes accepted (WebSocket frames and OpenAI API streams)."),
    "cancels_total": ("counter", "Cancels published (by a client frame or after the grace period)."),
    "grace_cancels_total": ("counter", "Requests cancelled because their client went away and nobody resumed them."),
    "events_relayed_total": ("counter", "Worker events queued to WebSocket clients."),
    "stream_fills_total": ("counter", "Reads of an events stream (resume, gap or idle catch-up)."),
    "slow_consumer_closes_total": ("counter", "Connections closed because their send queue overflowed."),
    "redis_errors_total": ("counter", "Redis commands or pub/sub reads that failed."),
}

# The protocols a client reaches the gateway with: `ws` (the /ws socket) and `openai` (a streamed
# OpenAI API answer); for open connections the OpenAI API's are its Server-Sent Events streams (`sse`).
FIRST_TOKEN_PROTOCOLS = ("ws", "openai")
OPEN_PROTOCOLS = ("ws", "sse")
# Why a tenant's request was refused (tenants.py): its max_concurrent, or its tokens_per_minute.
TENANT_REJECT_REASONS = ("concurrency", "tokens")

# vLLM's buckets for vllm:time_to_first_token_seconds, so the gateway's histogram (what the client
# sees) and the worker's (what the engine sees) can be compared bucket by bucket: the difference is
# the queue, the Redis hops and the relay. From 1 ms (a warm prefix cache) to 43 min (a deep queue).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._plain: dict[str, Counter | Gauge] = {}
        for name, (kind, help_text) in _METRICS.items():
            cls = Counter if kind == "counter" else Gauge
            self._plain[name] = cls(PREFIX + name, help_text, registry=self.registry)
        self._errors = Counter(PREFIX + "errors_total", "Error frames sent to clients, by code.", ["code"],
                               registry=self.registry)
        self._first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from pushing a job to relaying its first token to the client, by protocol "
            "(ws: /ws generate frames; openai: streamed OpenAI API answers).",
            ["protocol"], buckets=TTFT_BUCKETS, registry=self.registry)
        self._open = Gauge(PREFIX + "open_connections",
                           "Client connections streaming now, by protocol (ws: WebSocket sockets; sse: "
                           "Server-Sent Events streams of the OpenAI API).", ["protocol"], registry=self.registry)
        self._tenant_admitted = Counter(PREFIX + "tenant_admitted_total",
                                        "Jobs admitted under their tenant's limits, by tenant.", ["tenant"],
                                        registry=self.registry)
        self._tenant_rejected = Counter(PREFIX + "tenant_rejected_total",
                                        "Jobs refused by their tenant's limits (never pushed), by tenant and "
                                        "reason (concurrency: max_concurrent; tokens: tokens_per_minute).",
                                        ["tenant", "reason"], registry=self.registry)
        self._tenant_tokens = Counter(PREFIX + "tenant_tokens_charged_total",
                                      "Tokens charged against tokens_per_minute at admission (prompt + "
                                      "max_tokens per sample), by tenant.", ["tenant"], registry=self.registry)
        self._routed = Counter(PREFIX + "routed_total",
                               "Jobs pushed, by routing outcome: session (to the worker holding the "
                               "session), hit (to a worker holding a long enough prefix), miss (no worker "
                               "held one: shared lanes), fallback (the workers holding it were full: shared "
                               "lanes), shared (routing off or a single worker), balanced (sent by load alone: the "
                               "random and least_loaded policies).", ["outcome"],
                               registry=self.registry)
        for outcome in ROUTING_OUTCOMES:
            self._routed.labels(outcome)
        # Every labelled series exists from the start (at 0), so a dashboard shows 0, not "no data",
        # before the first request of a protocol, and rate() has a starting point.
        for protocol in FIRST_TOKEN_PROTOCOLS:
            self._first_token.labels(protocol)
        for protocol in OPEN_PROTOCOLS:
            self._open.labels(protocol)
        # Read-only view by short name (`values["requests_total"]`), for code and tests that check a count.
        self.values: Mapping[str, float] = _Values(self)

    def add_tenants(self, tenants: list[str]) -> None:
        """The configured tenants' series, at 0 from the start (a dashboard shows 0, not "no data")."""
        for tenant in tenants:
            self._tenant_admitted.labels(tenant)
            self._tenant_tokens.labels(tenant)
            for reason in TENANT_REJECT_REASONS:
                self._tenant_rejected.labels(tenant, reason)

    def tenant_admitted(self, tenant: str, jobs: int, tokens: int) -> None:
        self._tenant_admitted.labels(tenant).inc(jobs)
        self._tenant_tokens.labels(tenant).inc(tokens)

    def tenant_rejected(self, tenant: str, reason: str, jobs: int) -> None:
        self._tenant_rejected.labels(tenant, reason).inc(jobs)

    def inc(self, name: str, by: float = 1) -> None:
        self._plain[name].inc(by)

    def routed(self, outcome: str) -> None:
        """Where the router sent a job (clients/routing.py OUTCOMES)."""
        self._routed.labels(outcome).inc()

    def error(self, code: str) -> None:
        """An error frame (or response) with this code was sent."""
        self._errors.labels(code).inc()

    def first_token(self, protocol: str, pushed_at: float) -> None:
        """The first token of a job pushed at `pushed_at` (time.monotonic()) was relayed to its client."""
        self._first_token.labels(protocol).observe(max(0.0, time.monotonic() - pushed_at))

    def open_connections(self, protocol: str) -> Gauge:
        return self._open.labels(protocol)

    def track(self, name: str, read: Callable[[], float]) -> None:
        """Gauge `name` reads `read()` at each scrape (no bookkeeping on the hot path)."""
        gauge = self._plain[name]
        assert isinstance(gauge, Gauge), name
        gauge.set_function(read)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The page and its content type: Prometheus' text format, or OpenMetrics when the scraper's
        `Accept` asks for it."""
        encode, content_type = choose_encoder(accept or "")
        return encode(_WithoutCreated(self.registry)), content_type  # type: ignore[arg-type]


class _WithoutCreated:
    """The registry without prometheus_client's `*_created` samples (each counter's and histogram's
    start time): they would double the series on the page, and a gauge named
    `streamer_gateway_connections_created` reads like a count of connections. Filtered here, not with
    the library's process-wide switch, which would change other registries in the same process too."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class _Values(Mapping[str, float]):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def __getitem__(self, name: str) -> float:
        if name not in _METRICS:
            raise KeyError(name)
        value = self._metrics.registry.get_sample_value(PREFIX + name)
        return 0.0 if value is None else value

    def __iter__(self) -> Iterator[str]:
        return iter(_METRICS)

    def __len__(self) -> int:
        return len(_METRICS)
