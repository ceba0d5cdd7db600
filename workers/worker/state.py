"""What the parts of the Redis worker share: the jobs it holds (in flight or being admitted), the
capacity that leaves, the stop flag, and the records one job entry travels as.

`Worker` (redis_worker.py) builds one `WorkerState` and hands it to each part: intake spends
capacity, job tasks give it back, the heartbeat refreshes what is held, the cancel listener looks
jobs up. They change it only through these methods and fields, never keep a copy.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from clients.errors import ProtocolError
from clients.names import BATCH_PRIORITY
from clients.protocol import Job
from clients.resume import ResumeState
from workers.worker.attempts import PreviousAttempt
from workers.worker.job_trace import NO_TRACE, NoTrace

log = logging.getLogger("streamer.worker")
_MAX_REMEMBERED_CANCELS = 10_000


@dataclass
class Delivery:
    """One entry handed to this worker, decoded, with its id claimed and its earlier events read."""

    entry_id: str
    fields: Any
    deliveries: int
    stream: str = ""  # the request stream it was read from
    charged_to: str = ""  # the tenant's service field charged when it was taken (streams.py)
    charged: float = 0.0
    origin: str = ""  # the entry it was pushed as, when a worker moved it (lanes.py, affinity.py)
    job: Job | None = None
    error: ProtocolError | None = None  # could not be decoded or validated
    ours: bool = False  # the request id belongs to this entry (not a duplicate)
    epoch: int = 0  # ownership epoch of this claim (Names.fence); 0 when not ours
    previous: PreviousAttempt = field(default_factory=PreviousAttempt)  # the attempt before this claim
    state: ResumeState = field(default_factory=ResumeState)
    cancelled: bool = False
    # It left the intake's count of jobs on their way into the engine (WorkerState.admitted), whether
    # the engine took it or not: counted once, however the job ends.
    admitted: bool = False
    trace: NoTrace = NO_TRACE

    @property
    def request_id(self) -> str | None:
        return self.job.id if self.job is not None else self.error.request_id if self.error else None

    @property
    def suspect(self) -> bool:
        """The previous attempt entered the engine and its worker died before any output."""
        return self.previous.died_in(self.state.next_seq, self.state.finished)


@dataclass
class RunningJob:
    job: Job
    entry_id: str
    next_seq: int
    fields: Any = None  # the raw entry, kept for dead letters
    stream: str = ""  # the request stream holding the entry
    epoch: int = 0  # ownership epoch: Redis refuses our writes once another worker claims the job
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    tokens: int = 0  # prompt and generated tokens, once it finished (its tenant's real charge)
    answer: str | None = None  # the first sample's whole text, once it finished
    trace: NoTrace = NO_TRACE  # its spans here (job_trace.py), when tracing is on


class WorkerState:
    """The jobs one worker holds and the flags its tasks coordinate on."""

    def __init__(self, admission_capacity: Callable[[], int], seats: Callable[[], int] = lambda: 0) -> None:
        self._admission_capacity = admission_capacity
        self._seats = seats  # the engine's max_num_seqs (0: unknown, no seats beyond `capacity()`)
        self.running: dict[str, RunningJob] = {}  # request id -> job
        # (request stream, entry id) -> request id, until acked: entry ids are unique per stream only
        self.pending_entries: dict[tuple[str, str], str] = {}
        self.starting = 0  # jobs read but not yet admitted by the engine (capacity already spent)
        self._cancelled: OrderedDict[str, float] = OrderedDict()  # cancels seen for jobs not running here
        self._capacity_freed = anyio.Event()
        self._stop = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self.ready = anyio.Event()  # set once the worker reads jobs
        self.engine_error: BaseException | None = None
        self.unproven = 0  # jobs in the engine without their first output yet
        self._solo = False  # a suspect job (attempts.py) is entering the engine alone
        self._gate = anyio.Event()

    # --- stopping ----------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_stop(self) -> None:
        await self._stop.wait()

    # --- capacity and held jobs ------------------------------------------------------------------

    def capacity(self) -> int:
        """Jobs we may take now: what the engine can admit, less jobs read and not yet admitted."""
        return max(0, int(self._admission_capacity()) - self.starting)

    def urgent_capacity(self) -> int:
        """Jobs more urgent than batch lines we may take now: `capacity()`, and besides it the seats the
        batch lines held here have in the engine, which preempts them (recomputed later) for more urgent
        work, within the engine's seats less the urgent jobs held. So batch lines never keep an
        interactive job waiting in Redis for a seat (docs/scheduling.md)."""
        capacity = self.capacity()
        batch = sum(1 for run in self.running.values() if run.job.priority >= BATCH_PRIORITY)
        if not batch:
            return capacity
        # Jobs being admitted count as urgent (a batch line among them twice, until the engine took it):
        # an estimate that errs towards taking fewer.
        urgent_held = len(self.running) - batch + self.starting
        return max(capacity, min(capacity + batch, self._seats() - urgent_held))

    async def wait_capacity(self, urgent: bool = False) -> int:
        """Until `capacity()` (`urgent_capacity()` with `urgent`) is above 0; returns it."""
        while (n := self.urgent_capacity() if urgent else self.capacity()) <= 0:
            self._capacity_freed = anyio.Event()
            with anyio.move_on_after(0.05):  # KV blocks also free up without a job finishing here
                await self._capacity_freed.wait()
        return n

    @property
    def held(self) -> int:
        """Jobs in flight or being admitted."""
        return len(self.running) + self.starting

    def job_read(self, stream: str, entry_id: str, request_id: str) -> None:
        """An entry is taken: its capacity is spent until `admitted`, its entry held until acked."""
        self.starting += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self.pending_entries[stream, entry_id] = request_id

    def admitted(self) -> None:
        """Called once per `job_read`, when the engine took the job or it was answered otherwise."""
        self.starting -= 1
        self._capacity_freed.set()

    def job_ended(self, entry_id: str, request_id: str | None) -> None:
        run = self.running.get(request_id or "")
        if run is not None and run.entry_id == entry_id:
            del self.running[run.job.id]
        if not self.running and not self.starting:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no job is in flight or being admitted."""
        await self._idle.wait()

    def fenced(self, request_id: str, epoch: int) -> None:
        """Redis refused our writes for the job claimed with `epoch`: another worker took it over
        (this one was presumed dead). Stop it here at once and stop refreshing its entry."""
        run = self.running.get(request_id)
        if run is None or run.epoch != epoch:
            return
        log.warning("request %s: taken over by another worker (epoch %d is stale), stopping here",
                    request_id, epoch)
        self.release_entry(run.stream, run.entry_id)
        run.scope.cancel()

    def release_entry(self, stream: str, entry_id: str) -> str | None:
        """The entry left its request stream (or another worker took it): stop refreshing it."""
        return self.pending_entries.pop((stream, entry_id), None)

    # --- entering the engine ------------------------------------------------------------------------

    async def enter_engine(self, suspect: bool) -> None:
        """Wait for the turn to enter the engine: a suspect goes in once no other job is waiting for
        its first output, and no job goes in with it until it has its own (`proven`)."""
        while self._solo or (suspect and self.unproven):
            if self._gate.is_set():
                self._gate = anyio.Event()
            await self._gate.wait()
        self._solo = suspect
        self.unproven += 1

    def proven(self, suspect: bool) -> None:
        """A job that `enter_engine`d has its first output (or left)."""
        self.unproven -= 1
        self._solo = self._solo and not suspect
        self._gate.set()

    # --- cancels of jobs not running here --------------------------------------------------------

    def remember_cancel(self, request_id: str) -> None:
        """A cancel for a job that may be read but not yet running here: kept for a while (bounded)."""
        self._cancelled[request_id] = time.monotonic()
        while len(self._cancelled) > _MAX_REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)

    def take_cancel(self, request_id: str) -> bool:
        return self._cancelled.pop(request_id, None) is not None


def as_str(value: Any) -> str:
    """A Redis reply field as text (the client returns bytes: its replies also carry binary payloads)."""
    return value.decode() if isinstance(value, bytes) else str(value)
