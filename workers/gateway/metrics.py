"""The gateway's counters and gauges, rendered in the Prometheus text exposition format (`GET /metrics`).

Plain dicts instead of a metrics library: the gateway runs on one event loop, so there is nothing to lock,
and the project takes no dependency for a dozen numbers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# name -> (type, help). Order here is the order on the page.
_METRICS: dict[str, tuple[str, str]] = {
    "connections_open": ("gauge", "WebSocket connections open now."),
    "connections_total": ("counter", "WebSocket connections accepted."),
    "connections_refused_total": ("counter", "Handshakes refused (bad API key or origin, too many connections)."),
    "requests_inflight": ("gauge", "Requests being relayed to an open connection now."),
    "requests_total": ("counter", "Jobs pushed onto the requests stream."),
    "resumes_total": ("counter", "Resume frames accepted."),
    "cancels_total": ("counter", "Cancels published (by a client frame or after the grace period)."),
    "grace_cancels_total": ("counter", "Requests cancelled because their socket closed and nobody resumed them."),
    "events_relayed_total": ("counter", "Worker events queued to WebSocket clients."),
    "stream_fills_total": ("counter", "Reads of an events stream (resume, gap or idle catch-up)."),
    "slow_consumer_closes_total": ("counter", "Connections closed because their send queue overflowed."),
    "redis_errors_total": ("counter", "Redis commands or pub/sub reads that failed."),
}


@dataclass
class Metrics:
    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_METRICS, 0))
    # Error frames sent, by error code (a labelled counter).
    errors: Counter[str] = field(default_factory=Counter)

    def inc(self, name: str, by: float = 1) -> None:
        self.values[name] += by

    def render(self, prefix: str = "streamer_gateway_") -> str:
        lines: list[str] = []
        for name, (kind, help_text) in _METRICS.items():
            lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}",
                      f"{prefix}{name} {self.values[name]:g}"]
        lines += [f"# HELP {prefix}errors_total Error frames sent to clients, by code.",
                  f"# TYPE {prefix}errors_total counter"]
        lines += [f'{prefix}errors_total{{code="{code}"}} {n}' for code, n in sorted(self.errors.items())]
        return "\n".join(lines) + "\n"
