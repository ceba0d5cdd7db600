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

import contextlib
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
_DEAD_PAYLOAD_BYTES = 64 * 1024

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
    read_linger_ms: float = 3.0  # after a partial read, wait this long for more of a burst
    model_name: str = ""

    def __post_init__(self) -> None:
        self.consumer = self.consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_s = self.heartbeat_s or min(5.0, self.claim_idle_s / 4)


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
            # Deleting a consumer drops its pending entries: only leave when Redis says it holds none
            # (an entry delivered just as reading stopped is reclaimed by another worker instead).
            held = await self.redis.xpending_range(self.names.requests, self.names.group, "-", "+", 1,
                                                   consumername=self.cfg.consumer)
            if not held:
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
                entries = await self._read(count, self.cfg.block_ms)
                backoff.reset()
            except ResponseError as e:
                await self._refused("read", e, backoff)
                continue
            except TRANSIENT as e:
                await backoff.sleep(e)
                continue
            if 0 < len(entries) < count and self.cfg.read_linger_ms > 0:
                # Jobs pushed in a burst arrive over a few ms: gather them so they enter the engine
                # together (one prefill batch) instead of one step apart.
                await anyio.sleep(self.cfg.read_linger_ms / 1000)
                with contextlib.suppress(*TRANSIENT):
                    entries += await self._read(count - len(entries), None)
            await self._start_batch([(entry_id, fields, 1) for entry_id, fields in entries])

    async def _read(self, count: int, block_ms: int | None) -> list[tuple[Any, Any]]:
        reply = await self.redis.xreadgroup(self.names.group, self.cfg.consumer, {self.names.requests: ">"},
                                            count=count, block=block_ms)
        return [entry for _stream, entries in reply or [] for entry in entries]

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
                await self._refused("reclaim", e, backoff)
            except TRANSIENT as e:
                await backoff.sleep(e)

    async def _refused(self, what: str, error: ResponseError, backoff: Backoff) -> None:
        """Redis answered with an error: a lost group is recreated; anything else (out of memory, a
        key of the wrong type) is logged and retried with backoff, the worker stays up."""
        if "NOGROUP" in str(error):
            log.warning("consumer group missing (Redis lost its data?): creating it again")
            await self._ensure_group()
        else:
            log.error("%s: Redis refused: %s", what, error)
            await backoff.sleep(error)

    async def _start_reclaimed(self, entries: list[tuple[Any, Any]]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id, _ in entries:
                pipe.xpending_range(self.names.requests, self.names.group, entry_id, entry_id, 1)
            pending = await pipe.execute()
        batch = []
        for (entry_id, fields), info in zip(entries, pending, strict=True):
            deliveries = info[0]["times_delivered"] if info else 1
            log.info("reclaimed job entry %s (delivery %d)", _s(entry_id), deliveries)
            batch.append((entry_id, fields, deliveries))
        await self._start_batch(batch)

    async def _start_batch(self, entries: list[tuple[Any, Any, int]]) -> None:
        """Decode a batch of entries, claim their ids in entry order (the first of two jobs with the
        same id wins), read their resume state in one round trip, then start one task per job."""
        batch = []
        for entry_id, fields, deliveries in entries:
            d = Delivery(_s(entry_id), fields, deliveries)
            try:
                d.job = decode_job(fields or {}, self.cfg.limits)
            except ProtocolError as e:
                d.error = e
            batch.append(d)
        with_ids = [d for d in batch if d.request_id is not None]
        if with_ids:
            replies = await self._retry("load jobs", self._load_pipeline, with_ids)
            for i, d in enumerate(with_ids):
                _, owner, events, cancelled = replies[4 * i: 4 * i + 4]
                try:
                    for reply in (owner, events, cancelled):
                        if isinstance(reply, Exception):  # e.g. WRONGTYPE: a key of ours holds something else
                            raise ValueError(str(reply))
                    d.ours, d.cancelled = _s(owner) == d.entry_id, bool(cancelled)
                    d.state = resume_state(events)
                except (ValueError, KeyError, TypeError) as e:  # someone else wrote there: stay out of it
                    d.job, d.error = None, ProtocolError("damaged_events", f"keys of {d.request_id!r}: {e}")
        for d in batch:
            self._starting += 1
            self._jobs_idle = anyio.Event() if self._jobs_idle.is_set() else self._jobs_idle
            self._pending_entries[d.entry_id] = d.request_id or ""
            self._jobs.start_soon(self._job_task, d, name=f"job {d.entry_id}")

    async def _load_pipeline(self, batch: list[Delivery]) -> list[Any]:
        ttl = int(self.cfg.events_ttl_s * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in batch:
                request_id = d.request_id or ""
                pipe.set(self.names.job(request_id), d.entry_id, nx=True, px=ttl)
                pipe.get(self.names.job(request_id))
                pipe.xrange(self.names.events(request_id))
                pipe.exists(self.names.cancelled(request_id))
            return await pipe.execute(raise_on_error=False)

    # ---- one job ---------------------------------------------------------------------------------

    async def _job_task(self, d: Delivery) -> None:
        admitted = [False]
        try:
            if d.error is not None:
                await self._reject(d, d.error)
            else:
                await self._serve(d, admitted)
        except anyio.get_cancelled_exc_class():
            raise  # shutdown or lost ownership: no answer, another worker resumes it
        except EngineDeadError as e:  # not the job's fault: leave it unacked for a healthy worker
            log.error("request %s: engine is dead (%s); stopping this worker", d.request_id, e)
            self.engine_error = e
            self.request_stop()
        except Exception as e:
            log.exception("request %s (entry %s) failed", d.request_id, d.entry_id)
            try:
                await self._finish_with_error(d, "internal", f"worker error: {e}")
            except Exception:  # never let one job's failure take the others down
                log.exception("request %s (entry %s): could not report the failure", d.request_id,
                              d.entry_id)
        finally:
            if not admitted[0]:
                self._admitted()
            run = self._running.get(d.request_id or "")
            if run is not None and run.entry_id == d.entry_id:
                del self._running[run.job.id]
            if not self._running and not self._starting:
                self._jobs_idle.set()

    def _admitted(self) -> None:
        self._starting -= 1
        self._capacity.set()

    async def _serve(self, d: Delivery, admitted: list[bool]) -> None:
        job, entry_id, state = d.job, d.entry_id, d.state
        assert job is not None
        if not d.ours:
            await self._dead_letter(entry_id, d.fields, ProtocolError(
                "duplicate_id", f"id {job.id!r} is already used by another request", job.id))
            await self._ack(entry_id)
            return
        if state.finished:  # answered before, only the ack was lost
            await self._ack(entry_id)
            return
        run = RunningJob(job, entry_id, state.next_seq, d.fields)
        deliveries = d.deliveries
        if deliveries > self.cfg.max_deliveries:
            await self._fail(run, "too_many_deliveries",
                             f"job was delivered {deliveries} times without finishing")
            return
        try:
            params = SamplingParams.from_dict(job.params)
        except (TypeError, ValueError) as e:
            await self._fail(run, "invalid_params", str(e))
            return
        resume = state.resume_token_ids(params.n)
        if job.deadline is not None and resume is None and time.time() * 1000 > job.deadline:
            self._emit(run, [], error=ProtocolError("expired", "the deadline passed before the job started"))
            return
        if d.cancelled or self._cancelled.pop(job.id, None) is not None:
            self._emit(run, [done_event(job.id, run.next_seq, ["abort"] * params.n, _usage(0, 0, 0))])
            return
        self._running[job.id] = run
        with run.scope:
            await self._generate(run, params, state, resume, admitted)

    async def _generate(self, run: RunningJob, params: Any, state: ResumeState,
                        resume: list[list[int]] | None, admitted: list[bool]) -> None:
        prompt = await self._prompt(run)
        if prompt is None:
            return
        try:
            started = await self._admit(run, prompt, params, resume)
        finally:
            admitted[0] = True
            self._admitted()
        if started is not None:
            stream, first = started
            try:
                await self._relay(run, params, state, stream, first)
            finally:
                await stream.aclose()  # aborts the request in the engine unless it finished

    async def _prompt(self, run: RunningJob) -> Any:
        """The job's prompt as the engine takes it; None when the job was answered with an error."""
        job = run.job
        if job.prompt_token_ids is not None:
            return {"prompt_token_ids": job.prompt_token_ids}
        if job.messages is None:
            return job.prompt
        try:
            return {"prompt_token_ids": self.engine.render_chat(job.messages)}
        except ValueError as e:  # e.g. the checkpoint has no chat template
            await self._fail(run, "invalid_request", str(e))
            return None

    async def _admit(self, run: RunningJob, prompt: Any, params: Any,
                     resume: list[list[int]] | None) -> tuple[Any, Any] | None:
        """Hand the job to the engine: (output stream, first output), or None when it was answered
        instead (rejected by the engine, or its deadline passed before it started)."""
        job = run.job
        deadline = job.deadline if resume is None else None  # a resumed job has started already
        backoff_s = 0.05
        while True:
            stream = self.engine.generate(prompt, params, job.id, priority=job.priority,
                                          resume_token_ids=resume)
            try:
                first = await self._first_output(stream, deadline)
            except QueueFullError:  # admission raced with other load: the job waits, still ours
                await anyio.sleep(backoff_s)
                backoff_s = min(1.0, backoff_s * 2)
                continue
            except ValueError as e:  # prompt too long for the model and the like
                await self._fail(run, "invalid_request", str(e))
                return None
            except BaseException:
                # Interrupted while the engine was taking it: make sure it does not run unwatched.
                self.engine.abort(job.id)
                raise
            if first is None:
                self.engine.abort(job.id)
                self._emit(run, [], error=ProtocolError("expired", "the deadline passed before the job started"))
                return None
            return stream, first

    async def _first_output(self, stream: Any, deadline_ms: int | None) -> Any:
        """The stream's first output; None when `deadline_ms` passes first."""
        if deadline_ms is None:
            return await anext(stream)
        with anyio.move_on_after(max(0.0, deadline_ms / 1000 - time.time())):
            return await anext(stream)
        return None

    async def _relay(self, run: RunningJob, params: Any, state: ResumeState, stream: Any, out: Any) -> None:
        """Engine outputs -> events, one event per sample per step, until the request finishes."""
        job = run.job
        emitted = {k: len(v) for k, v in state.token_ids.items()}  # counts include a resumed run's
        reasons: dict[int, str] = {}
        while True:
            events = []
            for c in out.outputs:
                if c.token_ids:
                    events.append(token_event(job.id, run.next_seq + len(events), c.index,
                                              list(c.token_ids), c.text, c.logprobs))
                    emitted[c.index] = emitted.get(c.index, 0) + len(c.token_ids)
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
            if out.finished:
                usage = _usage(len(out.prompt_token_ids), sum(emitted.values()), out.num_cached_tokens)
                # Samples are n, or beam_width beams (which arrive whole, in the last output).
                count = max(params.n, 1 + max([*reasons, *emitted], default=0))
                events.append(done_event(job.id, run.next_seq + len(events),
                                         [reasons.get(k, "abort") for k in range(count)], usage))
                self._emit(run, events)
                return
            if events:
                self._emit(run, events, final=False)
            out = await anext(stream, None)
            if out is None:
                raise RuntimeError("engine stream ended without a finished output")

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

    async def _fail(self, run: RunningJob, code: str, message: str) -> None:
        """Answer a job we own with an error event and keep it in the dead letters."""
        error = ProtocolError(code, message[:300], run.job.id)
        log.info("request %s (entry %s): %s: %s", run.job.id, run.entry_id, code, error.message)
        await self._dead_letter(run.entry_id, run.fields, error)
        self._emit(run, [], error=error)

    async def _reject(self, d: Delivery, error: ProtocolError) -> None:
        """A job that failed decoding or validation: dead letter, and an error event when it has an id."""
        log.info("rejected entry %s (request %s): %s %s", d.entry_id, error.request_id, error.code,
                 error.message)
        await self._dead_letter(d.entry_id, d.fields, error)
        if error.request_id is None or not d.ours or d.state.finished:
            await self._ack(d.entry_id)  # never write into another request's stream
            return
        job = Job(id=error.request_id, encoding=_encoding_of(d.fields))
        self._emit(RunningJob(job, d.entry_id, d.state.next_seq, d.fields), [], error=error)

    async def _finish_with_error(self, d: Delivery, code: str, message: str) -> None:
        run = self._running.get(d.request_id or "")
        if run is None or run.entry_id != d.entry_id:
            await self._reject(d, ProtocolError(code, message[:300], d.request_id))
        else:
            await self._fail(run, code, message)

    async def _dead_letter(self, entry_id: str, fields: Any, error: ProtocolError) -> None:
        entry: dict[str, Any] = {"reason": error.code, "message": error.message, "entry": entry_id,
                                 "worker": self.cfg.consumer, "time_ms": int(time.time() * 1000)}
        if error.request_id is not None:
            entry["id"] = error.request_id
        for key, value in (fields or {}).items():
            # Keep enough to diagnose; an oversized payload is not copied whole.
            entry[f"payload_{_s(key)}"] = value[:_DEAD_PAYLOAD_BYTES]
            if len(value) > _DEAD_PAYLOAD_BYTES:
                entry["payload_bytes"] = len(value)
        await self._retry("dead letter", self.redis.xadd, self.names.dead, entry, maxlen=100_000,
                          approximate=True)

    async def _ack(self, entry_id: str) -> None:
        async def ack() -> None:  # a fresh pipeline per attempt: a failed execute empties it
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(self.names.requests, self.names.group, entry_id)
                pipe.xdel(self.names.requests, entry_id)
                for reply in await pipe.execute(raise_on_error=False):
                    if isinstance(reply, TRANSIENT):
                        raise reply
                    if isinstance(reply, Exception):  # e.g. NOGROUP: nothing left to ack
                        log.warning("ack of entry %s refused: %s", entry_id, reply)

        await self._retry("ack", ack)
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
            except ResponseError as e:  # e.g. NOGROUP after Redis lost its data: the reader recreates it
                log.warning("heartbeat: %s", e)
            await anyio.sleep(self.cfg.heartbeat_s)

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {"model": self.cfg.model_name, "consumer": self.cfg.consumer, "pid": os.getpid(),
                "running": s.get("num_running", 0), "waiting": s.get("num_waiting", 0),
                "kv_usage": s.get("kv_utilization", 0.0), "kv_blocks_used": s.get("kv_blocks_used", 0),
                "kv_blocks_total": s.get("kv_blocks_total", 0), "jobs": len(self._running) + self._starting,
                "writer_round_trips": self.writer.round_trips, "updated_ms": int(time.time() * 1000)}

    async def _heartbeat(self, key: str, ttl_ms: int) -> None:
        entries, running = list(self._pending_entries), list(self._running)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={k: str(v) for k, v in self.stats().items()})
            pipe.pexpire(key, ttl_ms)
            for request_id in running:  # cancel markers catch cancels published while pub/sub was down
                pipe.exists(self.names.cancelled(request_id))
            replies = await pipe.execute()
        for request_id, marked in zip(running, replies[2:], strict=True):
            if marked:
                self.cancel(request_id)
        if not entries:
            return
        # Reset the idle time of our entries so no other worker reclaims them.
        lost = await self._refresh_own(keys=[self.names.requests],
                                       args=[self.names.group, self.cfg.consumer, *entries])
        for entry_id in map(_s, lost):
            request_id = self._pending_entries.pop(entry_id, None)
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
