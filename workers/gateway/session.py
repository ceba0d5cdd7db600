"""One WebSocket connection: client frames in, worker events out, through a bounded send queue.

Frames are handled one at a time in arrival order (a `cancel` sent right after its `generate` is seen
after the job was pushed). Nothing a client sends can end the connection except an oversized frame
beyond the hard limit (the server closes with 1009) or not reading fast enough (closed with
CLOSE_SLOW_CONSUMER); every other mistake is answered with an `error` frame that carries the frame's
request id whenever it can be read (also from a frame too large, too deep or broken inside a nested
value: clients.protocol.readable_id), so a client waiting for that request is never left waiting.
Everything a worker would refuse without being able to answer (nesting, text that is not Unicode,
size) is refused here, before the job is pushed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from clients.backoff import TRANSIENT
from clients.errors import ProtocolError
from clients.numbers import is_int
from clients.progress import JobStatus, Placement
from clients.protocol import VERSION, Limits, readable_id
from workers.gateway import frames
from workers.gateway.admission import check_job
from workers.gateway.config import GatewayConfig
from workers.gateway.hub import Hub
from workers.gateway.metrics import Metrics
from workers.gateway.resume import begin_resume, check_known
from workers.gateway.socket_conn import SocketClosed, SocketConn
from workers.gateway.submit import submit_jobs
from workers.gateway.tenants import RateLimited, TenantGate, client_id, job_id, tag
from workers.gateway.watch import FINAL_TYPES, Watch

log = logging.getLogger("streamer.gateway")

# Private-use close code (RFC 6455 4000-4999): the client read too slowly and its send queue overflowed.
# Its requests keep running for the grace period; reconnect and `resume` them.
CLOSE_SLOW_CONSUMER = 4008
SLOW_CONSUMER_REASON = "send queue overflow: reading too slowly; reconnect and resume"


class GraceCancels(Protocol):
    """The gateway's grace-period cancels, which outlive any one socket (server.py's `Gateway`)."""

    def cancel_later(self, request_id: str, since_ms: float) -> None:
        """A socket closed with this request unfinished (served on it since `since_ms`, wall clock):
        cancel it unless someone resumes it."""
        ...

    def keep(self, request_id: str) -> None:
        """The request is resumed (or cancelled by its client): no grace-period cancel."""
        ...


class Session:
    def __init__(self, ws: SocketConn, config: GatewayConfig, hub: Hub, metrics: Metrics,
                 limits: Limits, grace: GraceCancels, prompt_limit: Callable[[], int] = lambda: 0,
                 workers_alive: Callable[[], int | None] = lambda: None, *, gate: TenantGate | None = None,
                 tenant: str = "") -> None:
        self.ws, self.cfg, self.hub, self.metrics = ws, config, hub, metrics
        # The tenant of the key this socket authenticated with ("": none), and its limits' check.
        self.gate, self.tenant = gate, tenant
        self.limits, self.grace = limits, grace
        self.prompt_limit = prompt_limit  # longest prompt_token_ids a worker can take now (0: unknown)
        self.workers_alive = workers_alive  # live workers the gateway last saw (None: not known yet)
        self.requests: dict[str, Watch] = {}
        # Generated requests whose first token is not relayed yet: id -> when the job was pushed
        # (time.monotonic()), for the time-to-first-token histogram. Resumes are not timed.
        self._pushed_at: dict[str, float] = {}
        # Requests whose client asked for `status` frames (`"progress": true`) until their first event:
        # id -> where it was pushed (its stream and ordinal there), and the status last sent.
        self.progress: dict[str, Placement] = {}
        self._sent_status: dict[str, JobStatus] = {}
        self._queue: deque[tuple[str, int]] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self.closing = False

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._status_loop())]
        try:
            async for frame in self.ws.frames():
                await self._handle(frame)
        finally:
            self.closing = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            unfinished, self.requests = self.requests, {}
            for rid, w in unfinished.items():
                self.hub.relay.unwatch(w)
                self.grace.cancel_later(rid, w.started_ms)

    # --- sending -----------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        """Queue a frame. Never waits: a reader that cannot keep up is closed instead of stalling the
        Redis relay that feeds every other connection."""
        if self.closing:
            return
        n = frames.size(text)
        if self._queue and self._queued_bytes + n > self.cfg.send_queue_bytes:
            self.closing = True
            self._queue.clear()
            self.metrics.inc("slow_consumer_closes_total")
            log.warning("connection %s: send queue over %d bytes, closing (%d)", self.ws.id,
                        self.cfg.send_queue_bytes, CLOSE_SLOW_CONSUMER)
            self.hub.spawn(self._close_slow(), "close slow connection")
            return
        self._queue.append((text, n))
        self._queued_bytes += n
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            text, n = self._queue.popleft()
            self._queued_bytes -= n
            try:
                await self.ws.send(text)
            except SocketClosed:
                return  # the reader loop ends with the socket

    async def _close_slow(self) -> None:
        # The close frame queues behind what the kernel already holds; a reader that never drains it
        # is cut off after close_timeout.
        await self.ws.close(CLOSE_SLOW_CONSUMER, SLOW_CONSUMER_REASON, self.cfg.close_timeout_s)

    async def close(self, code: int, reason: str) -> None:
        """The gateway shuts down (1001): clients reconnect, here or elsewhere, and resume."""
        self.closing = True
        await self.ws.close(code, reason, self.cfg.close_timeout_s)

    def error(self, request_id: str | None, code: str, message: str, extra: dict[str, Any] | None = None) -> None:
        self.metrics.error(code)
        self.send(frames.error_frame(request_id, code, message, extra))

    # --- frames ------------------------------------------------------------------------------------

    async def _handle(self, frame: str | bytes) -> None:
        if isinstance(frame, bytes):
            return self.error(None, "bad_frame", "frames must be JSON text, not binary")
        if len(frame) > self.cfg.max_frame_bytes or frames.size(frame) > self.cfg.max_frame_bytes:
            return self.error(readable_id(frame), "too_large", f"frame is over {self.cfg.max_frame_bytes} bytes")
        try:
            # NaN and Infinity are Python's extension, not JSON: nobody else could read such a job.
            obj = json.loads(frame, parse_constant=frames.reject_constant)
        except RecursionError:
            return self.error(readable_id(frame), "bad_json", "frame is nested too deeply to decode")
        except ValueError as e:
            return self.error(readable_id(frame), "bad_json", f"frame is not JSON: {e}"[:200])
        if not isinstance(obj, dict):
            return self.error(None, "bad_frame", "a frame must be a JSON object with a `type`")
        rid = frames.frame_id(obj)
        handler = {"generate": self._generate, "cancel": self._cancel, "resume": self._resume}.get(
            obj.get("type"))  # type: ignore[arg-type]
        if handler is None:
            return self.error(rid, "unknown_type", f"unknown frame type {obj.get('type')!r}"[:200]
                              + "; expected generate, cancel or resume")
        try:
            await handler(obj)
        except RateLimited as e:  # `retry_after`: whole seconds (absent: retrying cannot help)
            extra = {} if e.retry_after_s is None else {"retry_after": e.retry_after_s}
            self.error(self._client_id(e.request_id) or rid, e.code, e.message, extra)
        except ProtocolError as e:
            self.error(self._client_id(e.request_id) or rid, e.code, e.message)
        except TRANSIENT as e:
            self.metrics.inc("redis_errors_total")
            log.warning("request %s: Redis unavailable: %r", rid, e)
            self.error(rid, "redis_unavailable", "the gateway cannot reach Redis right now; retry shortly")
        except Exception as e:  # a bug, or Redis refusing a command: answered, and the socket goes on
            log.exception("request %s: %s frame failed", rid, obj.get("type"))
            self.error(rid, "internal", f"the gateway failed on this frame ({type(e).__name__}); "
                       "retry, or report it if it persists")

    def _client_id(self, rid: str | None) -> str | None:
        """The id the client knows a request by: without the tenant that namespaces it in Redis."""
        return None if rid is None else client_id(self.tenant, rid)

    def _accepted(self, rid: str) -> dict[str, Any]:
        """`workers: 0` tells the client at once that nobody is serving (the job still waits)."""
        frame: dict[str, Any] = {"type": "accepted", "id": self._client_id(rid)}
        alive = self.workers_alive()
        if alive is not None:
            frame["workers"] = alive
        return frame

    def _check_room(self, rid: str) -> None:
        if rid in self.requests:
            raise ProtocolError("duplicate_id", f"request {rid!r} is already streaming on this connection",
                                rid)
        if len(self.requests) >= self.cfg.max_inflight:
            raise ProtocolError("too_many_requests", f"at most {self.cfg.max_inflight} requests in flight "
                                "per connection: wait for one to finish or cancel one", rid)

    async def _generate(self, obj: dict[str, Any]) -> None:
        fields = {k: v for k, v in obj.items() if k not in ("type", "progress")}
        picked = fields.get("id") is None
        if picked:
            fields["id"] = uuid.uuid4().hex
        if isinstance(fields["id"], str):  # not a string: parse_job says what is wrong with it
            fields["id"] = job_id(self.tenant, fields["id"])
        job = tag({"v": VERSION, **fields}, self.tenant)  # the key's tenant, whatever the frame said
        try:
            rid = check_job(job, self.limits, self.prompt_limit()).id
        except ProtocolError as e:
            if picked:  # an id the client never saw names nothing for it
                e.request_id = None
            raise
        self._check_room(rid)

        async def subscribe() -> None:
            await self._watch(rid, 0, catch_up=False)  # before the job exists: no token is missed
            self.send(json.dumps(self._accepted(rid)))
            self._pushed_at[rid] = time.monotonic()  # before the push: a token can arrive before it returns

        async def undo() -> None:
            self._forget(rid)

        try:
            (placement,) = await submit_jobs(self.hub, self.gate, self.tenant, [job], self.prompt_limit(),
                                             subscribe, undo)
        except RateLimited as e:
            if picked:  # an id the client never saw names nothing for it
                e.request_id = None
            raise
        if frames.wants_progress(obj):
            self.progress[rid] = placement

    async def _resume(self, obj: dict[str, Any]) -> None:
        rid = job_id(self.tenant, frames.request_id(obj))
        after = obj.get("after_seq", -1)
        if not is_int(after) or not -1 <= after <= frames.MAX_SEQ:
            raise ProtocolError("invalid_request", "`after_seq` must be an integer >= -1 (the last seq "
                                "received; -1 replays from the start)", rid)
        self._check_room(rid)
        point = await begin_resume(self.hub, self.grace.keep, self.tenant, rid)
        last_seq = point.last_seq
        if point.finished and last_seq <= after:
            raise ProtocolError("already_finished", f"request {rid!r} finished at seq {last_seq}", rid)
        point.check_position(after)
        self.metrics.inc("resumes_total")
        if frames.wants_progress(obj):
            # What follows up to `last_seq` is replayed from Redis, not generated now: a client's
            # time to first token and tokens/s leave it out.
            self.send(json.dumps({"type": "resumed", "id": self._client_id(rid), "last_seq": last_seq}))
            if last_seq < 0:
                self.progress[rid] = None
        await self._watch(rid, after + 1, catch_up=True)

    async def _cancel(self, obj: dict[str, Any]) -> None:
        rid = job_id(self.tenant, frames.request_id(obj))
        if self.tenant:
            await check_known(self.hub, self.tenant, rid)
        self.grace.keep(rid)
        await self.hub.cancel(rid)

    # --- relaying ----------------------------------------------------------------------------------

    async def _watch(self, rid: str, next_seq: int, *, catch_up: bool) -> None:
        shown = self._client_id(rid)

        def on_event(event: dict[str, Any], text: str) -> None:
            self.metrics.inc("events_relayed_total")
            if shown != rid:  # the worker wrote the tenant's namespaced id; the client knows its own
                text = json.dumps({**event, "id": shown}, ensure_ascii=False, separators=(",", ":"))
            self.send(text)
            kind = event.get("type")
            if kind == "token" and rid in self._pushed_at and not self.closing:  # sent, not dropped
                self.metrics.first_token("ws", self._pushed_at.pop(rid))
            if kind in FINAL_TYPES:
                self.requests.pop(rid, None)
                self._pushed_at.pop(rid, None)

        w = await self.hub.relay.watch(rid, next_seq, on_event)
        if w.finished:
            return
        self.requests[rid] = w
        if catch_up:
            try:
                await self.hub.relay.fill(w)
            except BaseException:
                self._forget(rid)
                raise

    async def _status_loop(self) -> None:
        """Every status_every_s, a `status` frame for each request that asked for one and has no event
        yet, when its status changed."""
        if self.cfg.status_every_s <= 0:
            return
        while True:
            await asyncio.sleep(self.cfg.status_every_s)
            for rid in [rid for rid in self.progress if rid not in self.requests or self.requests[rid].next_seq]:
                self.progress.pop(rid, None)
                self._sent_status.pop(rid, None)
            if not self.progress:
                continue
            try:
                statuses = await self.hub.statuses(dict(self.progress))
            except (*TRANSIENT, ValueError) as e:  # only a display: the next round tries again
                log.debug("connection %s: no status this round: %r", self.ws.id, e)
                continue
            for rid, status in statuses.items():
                if rid in self.progress and self._sent_status.get(rid) != status:
                    self._sent_status[rid] = status
                    self.send(json.dumps(status.frame(self._client_id(rid) or rid)))

    def _forget(self, rid: str) -> None:
        self._pushed_at.pop(rid, None)
        w = self.requests.pop(rid, None)
        if w is not None:
            self.hub.relay.unwatch(w)
