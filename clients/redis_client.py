"""Python client for the Redis protocol (docs/protocol.md): submit, stream, generate, cancel.

`AsyncClient` is the implementation; `Client` is its blocking twin for scripts and notebooks
(it drives an AsyncClient on a private event-loop thread, so both behave the same).

Events are read from the request's event stream with XREAD, which makes `stream()` gapless and
resumable by construction: after a dropped connection it continues after the last seq it yielded.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ResponseError

from clients.backoff import TRANSIENT, Backoff, retry
from clients.chat_messages import merge_tool_call_deltas
from clients.errors import NoWorker, ProtocolError, RequestFailed, UnknownRequest, redact_url
from clients.heartbeats import as_names, live_args, live_script
from clients.progress import JobStatus, Placement, job_statuses
from clients.protocol import Names, decode_event, encode_job, event_stream_id
from clients.routing import Route, Router

log = logging.getLogger("streamer.client")

# How NoWorker's message ends: stream() leaves the job queued, generate() withdraws it.
STAYS_QUEUED = "the job stays queued: cancel it, or pass wait_for_worker=True to wait for a worker"
WITHDRAWN = "the job was withdrawn; pass wait_for_worker=True to wait for a worker instead"

# How long the keys a client sets live: the id's owner until a worker's first write renews it, and a
# cancel marker.
KEY_TTL_MS = 3_600_000

# Push a job and record which entry owns its id (`job:{id}`, the key workers also set when they read
# it), in one atomic round trip: from then on the id exists, so it can be cancelled while it waits in
# the queue. SET NX: a second job with the same id leaves the first one's owner in place and is refused
# by the worker as `duplicate_id`. A lane or tenant queue pushed to for the first time is registered
# (with its consumer group, from its start) so that every worker finds it.
# KEYS[1] = request stream, KEYS[2] = job:{id}, KEYS[3] = the stream registry; ARGV[1] = field (json |
# msgpack), ARGV[2] = payload, ARGV[3] = owner TTL (ms), ARGV[4] = the stream's lane rank ('': a
# worker's own stream, not registered), ARGV[5] = consumer group. Returns {entry id, the stream's
# entries-added count after it} (the count is the job's ordinal, from which clients/progress.py tells
# its place in the queue; Redis < 7 has none).
SUBMIT_SCRIPT = """
if ARGV[4] ~= '' and redis.call('ZADD', KEYS[3], 'NX', ARGV[4], KEYS[1]) == 1 then
  redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[5], '0', 'MKSTREAM')
end
local entry = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], entry, 'NX', 'PX', ARGV[3])
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then
    return {entry, info[i + 1]}
  end
end
return {entry, -1}
"""

# Cancel only an id that exists, in one round trip: a cancel marker is a key, and nobody must be able
# to create keys for made-up ids. KEYS[1] = cancelled:{id}, KEYS[2..] = keys any one of which proves
# the id was submitted (job:{id}, events:{id}, a gateway's claim); ARGV[1] = cancel channel,
# ARGV[2] = request id, ARGV[3] = the marker's TTL (ms). Returns 1, or 0 (and does nothing) for an
# unknown id.
CANCEL_SCRIPT = """
if redis.call('EXISTS', unpack(KEYS, 2)) == 0 then
  return 0
end
redis.call('SET', KEYS[1], '1', 'PX', ARGV[3])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""


async def push_job(redis: Any, names: Names, submit: Any, route: Route, request_id: str, field_name: str,
                   payload: bytes | str, guard: tuple[list[str], list[Any]] = ([], [])) -> Placement:
    """Push a job onto the stream `route` names and record its owner (`job:{id}`): SUBMIT_SCRIPT, one
    atomic round trip, on a single Redis. On a cluster the stream and `job:{id}` are in different
    slots, so they are separate commands: a client that dies between them leaves a job whose id exists
    only once a worker reads it (until then it cannot be cancelled); nothing else changes.
    Returns where it waits, with its ordinal there when known (clients/progress.py).
    `guard`: keys and arguments a script built on SUBMIT_SCRIPT adds after its own (the gateway's id
    claim); such a script answers nil when it refuses, raised here as `duplicate_id`."""
    stream, owner = route.stream, names.job(request_id)
    rank = "" if route.rank is None else str(route.rank)
    if not names.cluster:
        reply = await submit(keys=[stream, owner, names.streams, *guard[0]],
                             args=[field_name, payload, KEY_TTL_MS, rank, names.group, *guard[1]])
        if reply is None:
            raise ProtocolError("duplicate_id", f"id {request_id!r} is already used by another request", request_id)
        _entry, ordinal = reply
        return Placement(stream, int(ordinal) if int(ordinal) > 0 else None)
    if rank and await redis.zadd(names.streams, {stream: route.rank}, nx=True):
        with contextlib.suppress(ResponseError):  # BUSYGROUP: another submitter created it
            await redis.xgroup_create(stream, names.group, id="0", mkstream=True)
    entry = await redis.xadd(stream, {field_name: payload})
    await redis.set(owner, entry, nx=True, px=KEY_TTL_MS)
    return Placement(stream, None)


def connect(url: str, names: Names, **options: Any) -> Any:
    """An asyncio client of a single Redis, or of a Redis Cluster when `names.cluster`."""
    return (RedisCluster if names.cluster else Redis).from_url(url, **options)


@dataclass
class Generation:
    """The whole answer to a request, folded from its events."""

    id: str
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    finish_reason: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    events: int = 0
    tool_calls: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # per sample, OpenAI's shape

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    def add(self, event: dict[str, Any]) -> None:
        self.events += 1
        if event["type"] == "error":
            raise RequestFailed(self.id, event.get("code", "error"), event.get("message", ""))
        k = int(event.get("index", 0))
        self.token_ids.setdefault(k, []).extend(event.get("token_ids", []))
        self.texts[k] = self.texts.get(k, "") + event.get("text", "")
        if event.get("tool_calls"):
            merge_tool_call_deltas(self.tool_calls.setdefault(k, []), event["tool_calls"])
        if event["type"] == "done":
            self.finish_reason = event.get("finish_reason")
            self.finish_reasons = list(event.get("finish_reasons", [self.finish_reason]))
            self.usage = dict(event.get("usage", {}))


def build_job(request_id: str, prompt: str | None, messages: list[dict[str, Any]] | None,
              prompt_token_ids: list[int] | None, params: dict[str, Any] | None,
              priority: int | None, deadline: int | None, tools: list[dict[str, Any]] | None = None,
              session: str | None = None, tenant: str | None = None,
              tool_choice: str | dict[str, Any] | None = None, lora: str | None = None,
              traceparent: str | None = None) -> dict[str, Any]:
    job: dict[str, Any] = {"id": request_id, "params": dict(params or {})}
    given = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids}
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
    job.update(given)
    optional = {"priority": priority, "deadline": deadline, "tools": tools, "tool_choice": tool_choice,
                "session": session, "tenant": tenant, "lora": lora, "traceparent": traceparent}
    job.update({k: v for k, v in optional.items() if v is not None})
    return job


class AsyncClient:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "llm", encoding: str = "json",
                 names: Names | None = None, retry_s: float = 30.0, cluster: bool = False,
                 routing: str = "cache_load") -> None:
        """`retry_s`: how long submit() and cancel() keep retrying while Redis is unreachable.
        `cluster`: `url` is a node of a Redis Cluster (or pass `names` with `cluster=True`).
        `routing`: where jobs go with several workers (clients/routing.py; "shared": always the
        shared lanes)."""
        if encoding not in ("json", "msgpack"):
            raise ValueError("encoding must be json or msgpack")
        self.url, self.encoding, self.retry_s = url, encoding, retry_s
        self.names = names or Names(prefix=prefix, cluster=cluster)
        self.redis = connect(url, self.names, socket_connect_timeout=3)
        self._submit = self.redis.register_script(SUBMIT_SCRIPT)
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)
        self._live = live_script(self.redis)
        self.router = Router(self.redis, self.names, routing)
        self._placements: dict[str, Placement] = {}  # submitted here: id -> where it waits

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def submit(self, prompt: str | None = None, *, messages: list[dict[str, Any]] | None = None,
                     prompt_token_ids: list[int] | None = None, params: dict[str, Any] | None = None,
                     id: str | None = None, priority: int | None = None, deadline: int | None = None,
                     tools: list[dict[str, Any]] | None = None, session: str | None = None,
                     tenant: str | None = None, tool_choice: str | dict[str, Any] | None = None,
                     lora: str | None = None, traceparent: str | None = None) -> str:
        """Push a job; returns its id (a fresh UUID unless given). `tools`: function definitions the
        chat template renders (with `messages`); `tool_choice`: "auto" (the default with tools),
        "none", "required" or {"type": "function", "function": {"name": ...}}
        (docs/structured_outputs.md). `session`: calls of one conversation or agent share it (they go
        to the worker holding its KV, and light sessions overtake heavy ones). `tenant`: whose share
        the job counts against (a gateway sets it from the API key). `lora`: the registered LoRA
        adapter to run under (`streamer lora add`; docs/lora.md). `traceparent`: the W3C trace context
        the worker's spans join (docs/observability.md#traces)."""
        request_id = id or uuid.uuid4().hex
        job = build_job(request_id, prompt, messages, prompt_token_ids, params, priority, deadline, tools,
                        session, tenant, tool_choice, lora, traceparent)
        ((field_name, payload),) = encode_job(job, self.encoding).items()
        route = await retry("route", log, lambda: self.router.route(job), self.retry_s)
        # Safe to retry: if a lost reply hides a first XADD that worked, the second copy carries the
        # same id and is refused by the worker as a duplicate.
        placement = await retry("submit", log, lambda: push_job(self.redis, self.names, self._submit, route,
                                                                request_id, field_name, payload), self.retry_s)
        if len(self._placements) >= 4096:  # only for status(): a long-lived client keeps the newest
            self._placements.pop(next(iter(self._placements)))
        self._placements[request_id] = placement
        return request_id

    async def status(self, request_id: str) -> JobStatus:
        """Where a request is before its first token: queued (with its place when it was submitted by
        this client), starting, or its prompt's progress on a worker (clients/progress.py)."""
        statuses = await job_statuses(self.redis, self.names, {request_id: self._placements.get(request_id)})
        return statuses[request_id]

    async def live_workers(self) -> list[str]:
        """Consumer names of the workers alive now (their heartbeat is fresh), newest beat first."""
        return as_names(await self._live(**live_args(self.names)))

    async def stream(self, request_id: str, after_seq: int = -1, timeout: float | None = 300.0,
                     wait_for_worker: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The request's events with seq > after_seq, in order, until `done` or `error`.
        `timeout`: longest wait for the next event (TimeoutError), None for no limit.
        While nothing arrives, the heartbeat set is checked every second: with no worker alive for two
        checks in a row, NoWorker is raised (the job stays queued: cancel it, or read it again once a
        worker runs) unless `wait_for_worker`."""
        key = self.names.events(request_id)
        last = after_seq
        backoff = Backoff(f"stream {request_id}", log)
        waited_since = time.monotonic()
        no_worker = 0  # checks in a row that found no live worker
        while True:
            block_ms = 1000 if timeout is None else max(1, min(1000, int(timeout * 1000)))
            try:
                reply = await self.redis.xread({key: event_stream_id(last)}, block=block_ms, count=256)
                if not reply and not wait_for_worker:
                    no_worker = 0 if await self.live_workers() else no_worker + 1
                backoff.reset()
            except TRANSIENT as e:  # Redis dropped: reconnect and continue after `last`
                await backoff.sleep(e)
                continue
            if not reply:
                if no_worker >= 2:
                    raise NoWorker(request_id, self.no_worker_message(STAYS_QUEUED))
                if timeout is not None and time.monotonic() - waited_since > timeout:
                    raise TimeoutError(f"no event for request {request_id} in {timeout}s")
                continue
            no_worker = 0
            waited_since = time.monotonic()
            for _key, entries in reply:
                for _id, fields in entries:
                    event = decode_event(fields)
                    last = int(event["seq"])
                    yield event
                    if event["type"] in ("done", "error"):
                        return

    def no_worker_message(self, then: str) -> str:
        """What NoWorker says, ending with `then`: what became of the job and how to wait instead."""
        where = redact_url(self.url)
        return (f"no worker is serving {self.names.requests} on {where}: start one with `streamer worker "
                f"--redis {where}` or use `streamer up` ({then})")

    async def generate(self, prompt: str | None = None, *, timeout: float | None = 300.0,
                       wait_for_worker: bool = False, **kwargs: Any) -> Generation:
        """Submit and wait for the whole answer; RequestFailed on an error event. NoWorker (and the job
        cancelled) when no worker is alive to serve it, unless `wait_for_worker`."""
        request_id = await self.submit(prompt, **kwargs)
        result = Generation(request_id)
        try:
            async for event in self.stream(request_id, timeout=timeout, wait_for_worker=wait_for_worker):
                result.add(event)
        except NoWorker as e:
            await self.cancel(request_id)  # nobody asked to wait: it must not run later for no one
            raise NoWorker(request_id, self.no_worker_message(WITHDRAWN)) from e
        return result

    async def cancel(self, request_id: str) -> None:
        """Abort a request wherever it is: running (its worker listens) or still queued (the marker).
        UnknownRequest when no such request exists in Redis (never submitted, or expired): nothing is
        written then."""
        keys = [self.names.cancelled(request_id), self.names.job(request_id), self.names.events(request_id)]
        args = [self.names.cancel, request_id, KEY_TTL_MS]
        if not await retry("cancel", log, lambda: self._cancel(keys=keys, args=args), self.retry_s):
            raise UnknownRequest(request_id, f"no request {request_id!r} to cancel (never submitted, "
                                 "or expired)")


class Client:
    """Blocking version of AsyncClient, same methods."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from anyio.from_thread import start_blocking_portal

        self._portal_cm = start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        self._client: AsyncClient = self._portal.call(lambda: _make(*args, **kwargs))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._portal_cm is not None:
            self._portal.call(self._client.aclose)
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None

    def submit(self, prompt: str | None = None, **kwargs: Any) -> str:
        return self._portal.call(lambda: self._client.submit(prompt, **kwargs))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return self._portal.call(lambda: self._client.generate(prompt, **kwargs))

    def cancel(self, request_id: str) -> None:
        self._portal.call(self._client.cancel, request_id)

    def status(self, request_id: str) -> JobStatus:
        return self._portal.call(self._client.status, request_id)

    def stream(self, request_id: str, after_seq: int = -1, timeout: float | None = 300.0,
               wait_for_worker: bool = False) -> Iterator[dict[str, Any]]:
        agen = self._client.stream(request_id, after_seq, timeout, wait_for_worker)
        try:
            while True:
                try:
                    yield self._portal.call(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._portal.call(agen.aclose)


async def _make(*args: Any, **kwargs: Any) -> AsyncClient:
    return AsyncClient(*args, **kwargs)  # created on the portal's loop, where it is used
