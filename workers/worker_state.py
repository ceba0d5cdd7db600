"""What the parts of the Redis worker share: the jobs it holds (in flight or being admitted), the
capacity that leaves, the stop flag, and the records one job entry travels as.

Every part of `Worker` (workers/redis_worker.py) is a mixin on `WorkerState`, so they all see one
set of counters: intake spends capacity, job tasks give it back, the heartbeat refreshes what is held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.asyncio import Redis

from workers.event_writer import EventWriter
from workers.protocol import Job, ProtocolError
from workers.resume import ResumeState
from workers.worker_config import WorkerConfig


@dataclass
class Delivery:
    """One entry handed to this worker, decoded, with its id claimed and its earlier events read."""

    entry_id: str
    fields: Any
    deliveries: int
    job: Job | None = None
    error: ProtocolError | None = None  # could not be decoded or validated
    ours: bool = False  # the request id belongs to this entry (not a duplicate)
    state: ResumeState = field(default_factory=ResumeState)
    cancelled: bool = False

    @property
    def request_id(self) -> str | None:
        return self.job.id if self.job is not None else self.error.request_id if self.error else None


@dataclass
class RunningJob:
    job: Job
    entry_id: str
    next_seq: int
    fields: Any = None  # the raw entry, kept for dead letters
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class WorkerState:
    """Built once per worker; the mixins in workers/worker_*.py read and update it, never copy it."""

    _jobs: TaskGroup  # the task group of job tasks, open while `Worker.run` is

    def __init__(self, engine: Any, config: WorkerConfig) -> None:
        self.engine, self.cfg, self.names = engine, config, config.names
        self.redis = Redis.from_url(config.redis_url, socket_connect_timeout=2)
        self.writer = EventWriter(self.redis, self.names, int(config.events_ttl_s * 1000))
        self._running: dict[str, RunningJob] = {}  # request id -> job
        self._pending_entries: dict[str, str] = {}  # request-stream entry id -> request id, until acked
        self._starting = 0  # jobs read but not yet admitted by the engine (capacity already spent)
        self._cancelled: OrderedDict[str, float] = OrderedDict()  # cancels seen for jobs not running here
        self._capacity = anyio.Event()
        self._stop = anyio.Event()
        self._jobs_idle = anyio.Event()
        self._jobs_idle.set()
        self.ready = anyio.Event()
        self.engine_error: BaseException | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Stop reading new jobs; `run` finishes in-flight ones (within grace_s) and returns."""
        self._stop.set()

    def capacity(self) -> int:
        """Jobs we may take now: what the engine can admit, less jobs read and not yet admitted."""
        return max(0, int(self.engine.admission_capacity()) - self._starting)

    async def _wait_capacity(self) -> int:
        while (n := self.capacity()) <= 0:
            self._capacity = anyio.Event()
            with anyio.move_on_after(0.05):  # KV blocks also free up without a job finishing here
                await self._capacity.wait()
        return n

    def _admitted(self) -> None:
        self._starting -= 1
        self._capacity.set()


def as_str(value: Any) -> str:
    """A Redis reply field as text (the client returns bytes: its replies also carry binary payloads)."""
    return value.decode() if isinstance(value, bytes) else str(value)
