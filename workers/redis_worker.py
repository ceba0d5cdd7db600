"""The Redis streaming worker: jobs from a consumer group in, per-request events out (docs/protocol.md).

Task layout (anyio, one task group each, nothing outlives `Worker.run`):
  services: event writer, heartbeat (stats + keeping our pending entries fresh), cancel listener
  intake:   XREADGROUP reader and XAUTOCLAIM reclaimer, both stopped first on shutdown
  jobs:     one task per request, each owning its engine stream; cancelled (not answered) when the
            shutdown grace period runs out, so another worker resumes them
The engine steps in its own thread (AsyncEngine); job tasks only hand events to the writer, so
Redis I/O and generation never wait on each other.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from streamer import SamplingParams
from streamer.async_engine import EngineDeadError
from streamer.errors import QueueFullError
from workers.backoff import TRANSIENT, Backoff
from workers.event_writer import EventWriter, Write
from workers.protocol import (
    Job,
    Limits,
    Names,
    ProtocolError,
    decode_job,
    done_event,
    error_event,
    token_event,
)
from workers.resume import ResumeState, resume_state

log = logging.getLogger("streamer.worker")

# Refresh the idle time of our own pending entries, but only those still ours: an entry another
# worker has taken over (we were presumed dead) must not be stolen back. Returns the ids we lost.
_REFRESH_OWN = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


@dataclass
class WorkerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    names: Names = field(default_factory=Names)
    limits: Limits = field(default_factory=Limits)
    consumer: str = ""  # unique per process; default host-pid-random
    events_ttl_s: float = 3600.0
    claim_idle_s: float = 30.0  # an entry idle this long belongs to a dead worker and is reclaimed
    heartbeat_s: float = 0.0  # 0: claim_idle_s / 4, at most 5 s
    max_deliveries: int = 5  # a job delivered more often than this (it keeps killing workers) is dead
    grace_s: float = 30.0  # SIGTERM: time to finish in-flight jobs before leaving them to others
    block_ms: int = 1000
    model_name: str = ""

    def __post_init__(self) -> None:
        self.consumer = self.consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_s = self.heartbeat_s or min(5.0, self.claim_idle_s / 4)


@dataclass
class RunningJob:
    job: Job
    entry_id: str
    next_seq: int
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Worker:
    def __init__(self, engine: Any, config: WorkerConfig) -> None:
        self.engine, self.cfg, self.names = engine, config, config.names
        self.redis = Redis.from_url(config.redis_url, socket_connect_timeout=2)
        self.writer = EventWriter(self.redis, self.names, int(config.events_ttl_s * 1000))
        self._refresh_own = self.redis.register_script(_REFRESH_OWN)
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

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Stop reading new jobs; `run` finishes in-flight ones (within grace_s) and returns."""
        self._stop.set()

    async def run(self) -> None:
        cfg = self.cfg
        log.info("worker %s: model %s, group %s on %s", cfg.consumer, cfg.model_name, self.names.group,
                 self.names.requests)
        await self._ensure_group()
        try:
            async with anyio.create_task_group() as services:
                services.start_soon(self.writer.run)
                services.start_soon(self._heartbeat_loop)
                services.start_soon(self._cancel_loop)
                async with anyio.create_task_group() as jobs:
                    self._jobs = jobs
                    async with anyio.create_task_group() as intake:
                        intake.start_soon(self._read_loop)
                        intake.start_soon(self._claim_loop)
                        self.ready.set()
                        await self._stop.wait()
                        intake.cancel_scope.cancel()
                    log.info("worker %s: stopping, %d job(s) in flight (grace %.1fs)", cfg.consumer,
                             len(self._running) + self._starting, cfg.grace_s)
                    with anyio.move_on_after(cfg.grace_s):
                        await self._jobs_idle.wait()
                    if self._running or self._starting:
                        log.warning("worker %s: grace period over, leaving %s to other workers",
                                    cfg.consumer, sorted(self._running))
                    jobs.cancel_scope.cancel()
                self.writer.close()
                with anyio.move_on_after(max(5.0, cfg.grace_s / 2)):
                    await self.writer.wait_idle()
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self._leave()
            await self.redis.aclose()
        if self.engine_error is not None:
            raise RuntimeError(f"worker stopped: the engine failed ({self.engine_error})")

    async def _leave(self) -> None:
        try:
            await self.redis.delete(self.names.worker(self.cfg.consumer))
            if not self._pending_entries:  # with entries left, the consumer must stay for XAUTOCLAIM
                await self.redis.xgroup_delconsumer(self.names.requests, self.names.group, self.cfg.consumer)
        except TRANSIENT as e:
            log.warning("worker %s: could not deregister (%s)", self.cfg.consumer, e)

    async def _ensure_group(self) -> None:
        backoff = Backoff("create group", log)
        while True:
            try:
                # From id 0: jobs pushed before the first worker ever started are served too.
                await self.redis.xgroup_create(self.names.requests, self.names.group, id="0", mkstream=True)
                return
            except ResponseError as e:
                if "BUSYGROUP" in str(e):
                    return
                raise
            except TRANSIENT as e:
                await backoff.sleep(e)

    # ---- intake ----------------------------------------------------------------------------------

    def capacity(self) -> int:
        """Jobs we may take now: what the engine can admit, less jobs read and not yet admitted."""
        return max(0, int(self.engine.admission_capacity()) - self._starting)

    async def _wait_capacity(self) -> int:
        while (n := self.capacity()) <= 0:
            self._capacity = anyio.Event()
            with anyio.move_on_after(0.05):  # KV blocks also free up without a job finishing here
                await self._capacity.wait()
        return n

    async def _read_loop(self) -> None:
        backoff = Backoff("read", log)
        while True:
            count = await self._wait_capacity()
            try:
                reply = await self.redis.xreadgroup(self.names.group, self.cfg.consumer,
                                                    {self.names.requests: ">"}, count=count,
                                                    block=self.cfg.block_ms)
                backoff.reset()
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("consumer group missing (Redis lost its data?): creating it again")
                await self._ensure_group()
                continue
            except TRANSIENT as e:
                await backoff.sleep(e)
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    self._start_job(entry_id, fields, deliveries=1)

    async def _claim_loop(self) -> None:
        """Take over entries whose worker stopped refreshing them (dead), oldest first."""
        backoff = Backoff("reclaim", log)
        idle_ms = int(self.cfg.claim_idle_s * 1000)
        while True:
            await anyio.sleep(self.cfg.claim_idle_s / 2)
            cursor = "0-0"
            try:
                while (count := self.capacity()) > 0:
                    cursor, entries, *_ = await self.redis.xautoclaim(
                        self.names.requests, self.names.group, self.cfg.consumer, idle_ms,
                        start_id=cursor, count=count)
                    if entries:
                        await self._start_reclaimed(entries)
                    if cursor in (b"0-0", "0-0"):
                        break
                backoff.reset()
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                await self._ensure_group()
            except TRANSIENT as e:
                await backoff.sleep(e)

    async def _start_reclaimed(self, entries: list[tuple[Any, Any]]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id, _ in entries:
                pipe.xpending_range(self.names.requests, self.names.group, entry_id, entry_id, 1)
            pending = await pipe.execute()
        for (entry_id, fields), info in zip(entries, pending, strict=True):
            deliveries = info[0]["times_delivered"] if info else 1
            log.info("reclaimed job entry %s (delivery %d)", _s(entry_id), deliveries)
            self._start_job(entry_id, fields, deliveries)

    def _start_job(self, entry_id: Any, fields: Any, deliveries: int) -> None:
        entry_id = _s(entry_id)
        self._starting += 1
        self._jobs_idle = anyio.Event() if self._jobs_idle.is_set() else self._jobs_idle
        self._pending_entries[entry_id] = ""
        self._jobs.start_soon(self._job_task, entry_id, fields, deliveries, name=f"job {entry_id}")

    # ---- one job ---------------------------------------------------------------------------------

    async def _job_task(self, entry_id: str, fields: Any, deliveries: int) -> None:
        admitted = [False]
        request_id = None
        try:
            try:
                job = decode_job(fields or {}, self.cfg.limits)
            except ProtocolError as e:
                request_id = e.request_id
                await self._reject(entry_id, fields, e)
                return
            request_id = job.id
            self._pending_entries[entry_id] = job.id
            await self._serve(job, entry_id, deliveries, admitted)
        except anyio.get_cancelled_exc_class():
            raise  # shutdown or lost ownership: no answer, another worker resumes it
        except EngineDeadError as e:  # not the job's fault: leave it unacked for a healthy worker
            log.error("request %s: engine is dead (%s); stopping this worker", request_id, e)
            self.engine_error = e
            self.request_stop()
        except Exception as e:
            log.exception("request %s (entry %s) failed", request_id, entry_id)
            if request_id is not None:
                await self._finish_with_error(entry_id, request_id, "internal", f"worker error: {e}"[:300],
                                              fields)
        finally:
            if not admitted[0]:
                self._admitted()
            run = self._running.get(request_id or "")
            if run is not None and run.entry_id == entry_id:
                del self._running[request_id]
            if not self._running and not self._starting:
                self._jobs_idle.set()

    def _admitted(self) -> None:
        self._starting -= 1
        self._capacity.set()

    async def _load(self, job: Job, entry_id: str) -> tuple[bool, ResumeState, bool]:
        """Claim the request id for this entry and read what earlier runs emitted.
        Returns (the id is ours, resume state, a cancel is recorded)."""
        ttl = int(self.cfg.events_ttl_s * 1000)
        reply = await self._retry("load job", self._load_pipeline, job, entry_id, ttl)
        _, owner, entries, cancelled = reply
        return _s(owner) == entry_id, resume_state(entries), bool(cancelled)

    async def _load_pipeline(self, job: Job, entry_id: str, ttl: int) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.names.job(job.id), entry_id, nx=True, px=ttl)
            pipe.get(self.names.job(job.id))
            pipe.xrange(self.names.events(job.id))
            pipe.exists(self.names.cancelled(job.id))
            return await pipe.execute()

    async def _serve(self, job: Job, entry_id: str, deliveries: int, admitted: list[bool]) -> None:
        ours, state, cancelled = await self._load(job, entry_id)
        if not ours:
            await self._dead_letter(entry_id, None, ProtocolError(
                "duplicate_id", f"id {job.id!r} is already used by another request", job.id))
            await self._ack(entry_id)
            return
        if state.finished:  # answered before, only the ack was lost
            await self._ack(entry_id)
            return
        run = RunningJob(job, entry_id, state.next_seq)
        if deliveries > self.cfg.max_deliveries:
            error = ProtocolError("too_many_deliveries",
                                  f"job was delivered {deliveries} times without finishing", job.id)
            await self._dead_letter(entry_id, None, error)
            self._emit(run, [], error=error)
            return
        try:
            params = SamplingParams.from_dict(job.params)
        except (TypeError, ValueError) as e:
            error = ProtocolError("invalid_params", str(e)[:300], job.id)
            await self._dead_letter(entry_id, None, error)
            self._emit(run, [], error=error)
            return
        resume = state.resume_token_ids(params.n)
        if job.deadline is not None and resume is None and time.time() * 1000 > job.deadline:
            self._emit(run, [], error=ProtocolError("expired", "the deadline passed before the job started"))
            return
        if cancelled or self._cancelled.pop(job.id, None) is not None:
            self._emit(run, [done_event(job.id, run.next_seq, ["abort"] * params.n, _usage(0, 0, 0))])
            return
        self._running[job.id] = run
        with run.scope:
            await self._generate(run, params, state, resume, admitted)

    async def _generate(self, run: RunningJob, params: Any, state: ResumeState,
                        resume: list[list[int]] | None, admitted: list[bool]) -> None:
        job = run.job
        prompt: Any = job.prompt
        if job.prompt_token_ids is not None:
            prompt = {"prompt_token_ids": job.prompt_token_ids}
        elif job.messages is not None:
            prompt = {"prompt_token_ids": self.engine.render_chat(job.messages)}
        emitted = {k: len(v) for k, v in state.token_ids.items()}
        reasons: dict[int, str] = {}
        backoff_s = 0.05
        while True:
            stream = self.engine.generate(prompt, params, job.id, priority=job.priority,
                                          resume_token_ids=resume)
            try:
                first = await self._first_output(stream, job.deadline if resume is None else None)
                break
            except QueueFullError:  # admission raced with other load: the job waits, still ours
                await anyio.sleep(backoff_s)
                backoff_s = min(1.0, backoff_s * 2)
            except ValueError as e:  # prompt too long for the model and the like
                error = ProtocolError("invalid_request", str(e)[:300], job.id)
                await self._dead_letter(run.entry_id, None, error)
                self._emit(run, [], error=error)
                return
        admitted[0] = True
        self._admitted()
        if first is None:
            self._emit(run, [], error=ProtocolError("expired", "the deadline passed before the job started"))
            return
        out = first
        while True:
            events = []
            for c in out.outputs:
                if c.token_ids:
                    events.append(token_event(job.id, run.next_seq + len(events), c.index,
                                              list(c.token_ids), c.text))
                    emitted[c.index] = emitted.get(c.index, 0) + len(c.token_ids)
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
            if out.finished:
                n = params.n
                usage = _usage(len(out.prompt_token_ids), sum(emitted.values()), out.num_cached_tokens)
                events.append(done_event(job.id, run.next_seq + len(events),
                                         [reasons.get(k, "abort") for k in range(n)], usage))
                self._emit(run, events)
                return
            if events:
                self._emit(run, events, final=False)
            out = await anext(stream, None)
            if out is None:
                raise RuntimeError("engine stream ended without a finished output")

    async def _first_output(self, stream: Any, deadline_ms: int | None) -> Any:
        """The stream's first output; None when `deadline_ms` passes first (the request is aborted)."""
        if deadline_ms is None:
            return await anext(stream)
        with anyio.move_on_after(max(0.0, deadline_ms / 1000 - time.time())):
            return await anext(stream)
        await stream.aclose()
        return None

    # ---- answers ---------------------------------------------------------------------------------

    def _emit(self, run: RunningJob, events: list[dict], error: ProtocolError | None = None,
              final: bool = True) -> None:
        """Queue events for the writer; with `final`, the job's entry is acked once they are in Redis."""
        if error is not None:
            events = [*events, error_event(run.job.id, run.next_seq + len(events), error.code, error.message)]
        run.next_seq += len(events)
        entry = run.entry_id
        self.writer.put(Write(run.job.id, run.job.encoding, events, ack_entry=entry if final else None,
                              on_written=(lambda: self._pending_entries.pop(entry, None)) if final else None))

    async def _reject(self, entry_id: str, fields: Any, error: ProtocolError) -> None:
        """A job that failed decoding or validation: dead letter, and an error event when it has an id."""
        log.info("rejected entry %s (request %s): %s %s", entry_id, error.request_id, error.code,
                 error.message)
        await self._dead_letter(entry_id, fields, error)
        if error.request_id is None:
            await self._ack(entry_id)
            return
        job = Job(id=error.request_id, encoding=_encoding_of(fields))
        ours, state, _ = await self._load(job, entry_id)
        if not ours or state.finished:  # never write into another request's stream
            await self._ack(entry_id)
            return
        self._emit(RunningJob(job, entry_id, state.next_seq), [], error=error)

    async def _finish_with_error(self, entry_id: str, request_id: str, code: str, message: str,
                                 fields: Any) -> None:
        error = ProtocolError(code, message, request_id)
        run = self._running.get(request_id)
        if run is None or run.entry_id != entry_id:
            await self._reject(entry_id, fields, error)
            return
        await self._dead_letter(entry_id, fields, error)
        self._emit(run, [], error=error)

    async def _dead_letter(self, entry_id: str, fields: Any, error: ProtocolError) -> None:
        entry: dict[str, Any] = {"reason": error.code, "message": error.message, "entry": entry_id,
                                 "worker": self.cfg.consumer, "time_ms": int(time.time() * 1000)}
        if error.request_id is not None:
            entry["id"] = error.request_id
        for key, value in (fields or {}).items():
            entry[f"payload_{_s(key)}"] = value
        await self._retry("dead letter", self.redis.xadd, self.names.dead, entry, maxlen=100_000,
                          approximate=True)

    async def _ack(self, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.names.requests, self.names.group, entry_id)
            pipe.xdel(self.names.requests, entry_id)
            await self._retry("ack", pipe.execute)
        self._pending_entries.pop(entry_id, None)

    async def _retry(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        backoff = Backoff(what, log)
        while True:
            try:
                return await fn(*args, **kwargs)
            except TRANSIENT as e:
                await backoff.sleep(e)

    # ---- cancel, heartbeat -----------------------------------------------------------------------

    async def _cancel_loop(self) -> None:
        backoff = Backoff("cancel listener", log)
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.names.cancel)
                    backoff.reset()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.cancel(_s(message["data"]))
            except TRANSIENT as e:
                await backoff.sleep(e)

    def cancel(self, request_id: str) -> None:
        if request_id in self._running:
            log.info("request %s: cancelled", request_id)
            self.engine.abort(request_id)
            return
        # Maybe read but not yet running here: remember it for a while (bounded).
        self._cancelled[request_id] = time.monotonic()
        while len(self._cancelled) > 10_000:
            self._cancelled.popitem(last=False)

    async def _heartbeat_loop(self) -> None:
        backoff = Backoff("heartbeat", log)
        key = self.names.worker(self.cfg.consumer)
        ttl_ms = int(self.cfg.heartbeat_s * 3000)
        while True:
            try:
                await self._heartbeat(key, ttl_ms)
                backoff.reset()
            except TRANSIENT as e:
                await backoff.sleep(e)
                continue
            await anyio.sleep(self.cfg.heartbeat_s)

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {"model": self.cfg.model_name, "consumer": self.cfg.consumer, "pid": os.getpid(),
                "running": s.get("num_running", 0), "waiting": s.get("num_waiting", 0),
                "kv_usage": s.get("kv_utilization", 0.0), "kv_blocks_used": s.get("kv_blocks_used", 0),
                "kv_blocks_total": s.get("kv_blocks_total", 0), "jobs": len(self._running) + self._starting,
                "writer_round_trips": self.writer.round_trips, "updated_ms": int(time.time() * 1000)}

    async def _heartbeat(self, key: str, ttl_ms: int) -> None:
        entries = list(self._pending_entries)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={k: str(v) for k, v in self.stats().items()})
            pipe.pexpire(key, ttl_ms)
            await pipe.execute()
        if not entries:
            return
        # Reset the idle time of our entries so no other worker reclaims them.
        lost = await self._refresh_own(keys=[self.names.requests],
                                       args=[self.names.group, self.cfg.consumer, *entries])
        for entry_id in map(_s, lost):
            request_id = self._pending_entries.get(entry_id)
            run = self._running.get(request_id or "")
            if run is not None and run.entry_id == entry_id:
                log.warning("request %s: taken over by another worker, stopping here", request_id)
                run.scope.cancel()


def _usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}


def _encoding_of(fields: Any) -> str:
    keys = {_s(k) for k in (fields or {})}
    return "msgpack" if "msgpack" in keys and "json" not in keys else "json"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
