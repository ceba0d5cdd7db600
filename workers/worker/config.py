"""Settings of one Redis worker process (`streamer worker` flags map onto these)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from clients.protocol import Limits, Names
from workers.redis_options import DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_TIMEOUT_S
from workers.worker.steps import TraceConfig


@dataclass
class WorkerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_max_connections: int = DEFAULT_MAX_CONNECTIONS  # bound of the pool; more commands wait
    redis_pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S  # longest wait for a free connection
    names: Names = field(default_factory=Names)
    limits: Limits = field(default_factory=Limits)
    consumer: str = ""  # unique per process; default host-pid-random
    events_ttl_s: float = 3600.0
    claim_idle_s: float = 30.0  # an entry idle this long belongs to a dead worker and is reclaimed
    heartbeat_s: float = 0.0  # 0: claim_idle_s / 4, at most 5 s
    progress_every_s: float = 0.5  # how often a long prompt's progress is written (progress.py)
    traces: TraceConfig = field(default_factory=TraceConfig)  # slow-step traces (steps.py)
    max_deliveries: int = 5  # a job delivered more often than this (it keeps killing workers) is dead
    grace_s: float = 30.0  # SIGTERM: time to finish in-flight jobs before leaving them to others
    block_ms: int = 1000
    read_linger_ms: float = 3.0  # after a partial read, wait this long for more of a burst
    model_name: str = ""
    served_model_name: str = ""  # the name OpenAI-API clients ask for (heartbeat `served_model_name`)
    # How `tool_choice: auto` reads tool calls (workers/worker/tool_parsers.py): "auto" = the family the chat
    # template shows, "hermes" / "llama3_json" = that one, "none" = never.
    tool_call_parser: str = "auto"
    # Dead letters (answers.py): how much of a job's payload each keeps, and how long / how many are kept.
    dead_payload_bytes: int = 4096
    dead_max_age_s: float = 7 * 24 * 3600.0
    dead_max_len: int = 10_000
    # A consumer of the group that holds no entry and has not read for this long is deleted by the
    # reclaimer (a worker that crashed long ago); 0: 20 x claim_idle_s (10 min at the default).
    consumer_idle_s: float = 0.0
    # Prometheus metrics (metrics.py, queue_metrics.py) on http://metrics_host:metrics_port/metrics; 0: off.
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"

    def __post_init__(self) -> None:
        self.consumer = self.consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_s = self.heartbeat_s or min(5.0, self.claim_idle_s / 4)
        self.consumer_idle_s = self.consumer_idle_s or 20 * self.claim_idle_s
