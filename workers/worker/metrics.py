"""The worker's Prometheus metrics (docs/observability.md), served on `--metrics-port`.

The engine's are named and labelled as vLLM's (`vllm:...`, labels `model_name` and `engine`), so
vLLM's Grafana dashboards and alerts work unchanged; the worker's own (reclaims, dead letters, event
writes, Redis reconnects) are `streamer_worker_...` with a `worker` label, and the queue's are in
queue_metrics.py. Each worker has a registry of its own: several run in one process in the tests.

What the engine counts anyway (running, waiting, KV usage, prefix cache, preemptions) is read from
`engine.stats()` when Prometheus scrapes. What only the worker sees (a job's tokens, latencies and
finish reasons) is counted as its outputs pass through `JobRunner._relay`, one `RequestObserver` per
job. A job starts at its stream entry's id (milliseconds of the Redis server's clock), so the time it
spent in Redis before any worker read it counts; the engine stamps the later stages with
time.monotonic(), turned into wall-clock time with one offset taken at start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from streamer import RequestOutput, SamplingParams
from streamer.outputs import StepRecord
from workers.worker.engine import Engine
from workers.worker.metrics_server import MetricsServer

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per worker (vLLM numbers the engines of a data-parallel server)
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so panels and alerts written for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# One round trip of the event writer: well under a millisecond to a Redis on the same host.
EVENT_WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Read from engine.stats() at scrape time: (name, help, stats key).
_ENGINE_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_utilization"),
)
_ENGINE_COUNTERS = (  # prometheus_client adds `_total` to the exposed names
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_query_tokens"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hit_tokens"),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_decode_num_accepted_tokens"),
)
_PER_POSITION = ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                 "spec_decode_num_accepted_tokens_per_pos")


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


def entry_time_s(entry_id: str) -> float | None:
    """Wall-clock seconds at which Redis added a stream entry (its id is `<ms>-<seq>`)."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000
    except ValueError:
        return None


class _EngineStats:
    """Collector of what the engine counts itself, read when Prometheus scrapes."""

    def __init__(self, engine: Engine, labels: list[str]) -> None:
        self.engine, self.labels = engine, labels

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for name, help_text, key in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=LABELS)
            gauge.add_metric(self.labels, float(stats.get(key, 0)))
            yield gauge
        for name, help_text, key in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=LABELS)
            counter.add_metric(self.labels, float(stats.get(key, 0)))
            yield counter
        name, help_text, key = _PER_POSITION
        per_pos = CounterMetricFamily(name, help_text, labels=[*LABELS, "position"])
        for position, count in enumerate(stats.get(key) or []):
            per_pos.add_metric([*self.labels, str(position)], float(count))
        yield per_pos


class WorkerMetrics:
    def __init__(self, engine: Engine, model_name: str, worker: str) -> None:
        self.registry = r = CollectorRegistry()
        self.wall_offset = time.time() - time.monotonic()
        self._server: MetricsServer | None = None
        values = [model_name, ENGINE_INDEX]

        def counter(name: str, help_text: str) -> Any:
            return Counter(name, help_text, LABELS, registry=r).labels(*values)

        def histogram(name: str, help_text: str, buckets: Any) -> Any:
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=r).labels(*values)

        lengths = one_two_five(int(engine.stats().get("max_model_len") or 1 << 20))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*LABELS, "finished_reason"], registry=r)
        self._success_of = {reason: self._success.labels(*values, reason) for reason in FINISH_REASONS}
        self._values = values
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKENS_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                              "seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                               "for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING "
                                   "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                 "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                                "for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        lengths)
        self.request_generation = histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                            "processed.", lengths)
        self.request_max_generation = histogram("vllm:request_max_num_generation_tokens", "Histogram of maximum "
                                                "number of requested generation tokens.", lengths)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                           "parameter.", lengths)
        r.register(_EngineStats(engine, values))

        def per_worker(cls: Any, name: str, help_text: str, extra: tuple[str, ...] = (), **kw: Any) -> Any:
            metric = cls(name, help_text, ("worker", *extra), registry=r, **kw)
            return metric.labels(worker) if not extra else lambda *more: metric.labels(worker, *more)

        self.reclaims = per_worker(Counter, "streamer_worker_reclaims", "Job entries this worker took over "
                                   "from a dead worker (XAUTOCLAIM).")
        self.forwards = per_worker(Counter, "streamer_worker_session_forwards", "Jobs this worker took from a "
                                   "shared lane and forwarded to the worker holding their session.")
        self._dead = per_worker(Counter, "streamer_worker_dead_letters", "Jobs this worker dead-lettered, by "
                                "reason (the error code).", ("reason",))
        self.event_writes = per_worker(Histogram, "streamer_worker_event_write_seconds", "Round trips of the "
                                       "event writer (one pipeline of events and acks).",
                                       buckets=EVENT_WRITE_BUCKETS)
        self.reconnects = per_worker(Counter, "streamer_worker_redis_reconnects", "Times this worker's "
                                     "connection to Redis was lost (Redis restarted, the network dropped it) "
                                     "and made again.")

    # --- observations --------------------------------------------------------------------------------

    def request(self, entry_id: str, fresh: bool) -> RequestObserver:
        """The observer of one job's outputs; `fresh`: no earlier attempt wrote an event (a resumed job
        had its first token, and its time in the queue, counted by the worker that started it)."""
        return RequestObserver(self, entry_time_s(entry_id), fresh)

    def finished(self, reasons: list[str]) -> None:
        """One per sample, as vLLM counts each of a request's n samples as a request."""
        for reason in reasons:
            (self._success_of.get(reason) or self._success.labels(*self._values, reason)).inc()

    def observe_steps(self, records: list[StepRecord]) -> None:
        """A StepMonitor sink (steps.py)."""
        for record in records:
            self.iteration_tokens.observe(record.num_tokens)

    def dead_lettered(self, reason: str) -> None:
        self._dead(reason).inc()

    def reclaimed(self, stream: str) -> None:
        self.reclaims.inc()

    def forwarded(self) -> None:
        self.forwards.inc()

    def event_write(self, seconds: float) -> None:
        self.event_writes.observe(seconds)

    def reconnected(self) -> None:
        self.reconnects.inc()

    # --- serving ---------------------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> None:
        """GET /metrics on host:port (metrics_server.py) until `close`."""
        self._server = MetricsServer(self.registry, host, port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()


class RequestObserver:
    """One job's outputs, as `_relay` sees them: tokens and inter-token gaps per output, the rest once
    it finishes."""

    __slots__ = ("_m", "_entered", "_fresh", "_last")

    def __init__(self, metrics: WorkerMetrics, entered_s: float | None, fresh: bool) -> None:
        self._m, self._entered, self._fresh = metrics, entered_s, fresh
        self._last: float | None = None  # monotonic time of the last output with tokens

    def output(self, out: RequestOutput, new_tokens: int) -> None:
        if not new_tokens:
            return
        m, now = self._m, time.monotonic()
        m.generation_tokens.inc(new_tokens)
        if self._last is not None:
            m.itl.observe(now - self._last)
        else:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            first = out.metrics.first_token_time if out.metrics is not None else None
            if self._fresh and self._entered is not None:
                m.ttft.observe(max(0.0, (first or now) + m.wall_offset - self._entered))
        self._last = now

    def finished(self, out: RequestOutput, reasons: list[str], params: SamplingParams,
                 generated: dict[int, int]) -> None:
        m, t = self._m, out.metrics
        m.finished(reasons)
        m.request_prompt.observe(len(out.prompt_token_ids))
        m.request_generation.observe(sum(generated.values()))
        m.request_max_generation.observe(max(generated.values(), default=0))
        m.params_n.observe(params.n)
        if params.max_tokens:
            m.params_max_tokens.observe(params.max_tokens)
        if t is None or t.finished_time is None:
            return
        if self._entered is not None:
            m.e2e.observe(max(0.0, t.finished_time + m.wall_offset - self._entered))
        if t.first_scheduled_time is None:
            return
        if self._fresh and self._entered is not None:
            m.queue.observe(max(0.0, t.first_scheduled_time + m.wall_offset - self._entered))
        m.inference.observe(t.finished_time - t.first_scheduled_time)
        if t.first_token_time is not None:
            m.prefill.observe(t.first_token_time - t.first_scheduled_time)
            m.decode.observe(t.finished_time - t.first_token_time)
