"""The gateway's Redis side: push jobs, cancel them, track their ids; the events each request
gets are relayed by relay.py's EventRelay, which the hub owns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from clients.backoff import TRANSIENT
from clients.errors import ProtocolError
from clients.heartbeats import live_script, live_worker_stats
from clients.progress import JobStatus, Placement, job_statuses
from clients.protocol import Names, decode_payload, encode_job, split_fields
from clients.redis_client import CANCEL_SCRIPT, SUBMIT_SCRIPT, push_job
from clients.routing import Router
from clients.streams import all_streams
from workers.gateway.metrics import Metrics
from workers.gateway.relay import EventRelay
from workers.gateway.tenants import owner_claim
from workers.redis_options import async_client

log = logging.getLogger("streamer.gateway")

# How long an id claimed for a push stays reserved without its job: long enough for admission and
# the subscription under load, short enough that a claim whose push never happened (the gateway
# died, Redis went away) frees the id for the client's retry within seconds.
CLAIM_TTL_MS = 10_000
CLOSE_TIMEOUT_S = 10.0  # how long close() waits for its background tasks to end

# Prepended to SUBMIT_SCRIPT (its KEYS[1..3], ARGV[1..5]): KEYS[4] = the gateway's claim, KEYS[5] =
# events:{id}; ARGV[6] = the claim's token, ARGV[7] = how long the claim lasts once the job exists
# (ms). Refuses (nil) when another request holds the claim or the id already has a job or events;
# a claim that expired unseen is simply taken again.
CLAIM_GUARD = """
local held = redis.call('GET', KEYS[4])
if (held and held ~= ARGV[6]) or redis.call('EXISTS', KEYS[2], KEYS[5]) > 0 then
  return nil
end
redis.call('SET', KEYS[4], ARGV[6], 'PX', ARGV[7])
"""

# Delete a claim only when it is still this push's (KEYS[1] = claim, ARGV[1] = token).
RELEASE_CLAIM_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Hub:
    def __init__(self, redis_url: str, names: Names, metrics: Metrics, *, ttl_s: float = 3600.0,
                 idle_poll_s: float = 5.0, routing: str = "cache_load") -> None:
        self.names, self.metrics, self.ttl_ms = names, metrics, int(ttl_s * 1000)
        # The health check PINGs an idle connection (pub/sub included) now and then, so a connection
        # that died silently is noticed and replaced instead of waiting forever.
        self.redis = async_client(redis_url, cluster=names.cluster, socket_connect_timeout=5, socket_timeout=30,
                                  health_check_interval=15)
        # The Python client's scripts: a job's id exists from its push on, and only such ids can be
        # cancelled (no key for a made-up id).
        self._submit = self.redis.register_script(CLAIM_GUARD + SUBMIT_SCRIPT)
        self._claim_held = self.redis.register_script(CLAIM_GUARD + "return 1")
        self._release_claim = self.redis.register_script(RELEASE_CLAIM_SCRIPT)
        self.router = Router(self.redis, names, routing)
        self._cancel_known = self.redis.register_script(CANCEL_SCRIPT)
        self._live_workers = live_script(self.redis)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.relay = EventRelay(self.redis, names, metrics, self.spawn, idle_poll_s=idle_poll_s)
        self._runner: asyncio.Future[Any] | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.names.cluster:  # the slot map first: pub/sub picks its nodes by it
            await self.redis.initialize()
        self._runner = await self.relay.start()

    async def close(self) -> None:
        self.relay.closed = True  # before the cancels: its loops end on it even if a cancel is lost
        tasks = [*self._tasks, *([self._runner] if self._runner is not None else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a shutdown must end, even past a task that outlives its cancel.
            ended, stuck = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
            for task in ended:  # retrieved, so asyncio does not log them as never retrieved
                if not task.cancelled():
                    task.exception()
            for task in stuck:
                log.warning("closing: %s did not end within %.0f s of its cancel", task, CLOSE_TIMEOUT_S)
        await self.relay.close()
        await self.redis.aclose()

    def spawn(self, coro: Any, what: str) -> None:
        """A background task that is tracked (so close() can end it) and whose failure is logged."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %r", what, t.exception(), exc_info=t.exception())

        task.add_done_callback(done)

    # --- commands ----------------------------------------------------------------------------------

    def _claim_key(self, request_id: str) -> str:
        """Set by the gateway while it prepares a job's push: duplicate ids are refused before they
        reach a worker (and before a tenant is charged for them)."""
        return self.names.gateway_claim(request_id)

    async def claim(self, request_id: str, tenant: str = "") -> str | None:
        """Reserve an id for a job of `tenant` this gateway is about to push: a token for `push` and
        `release`, or None if the id is already in use. The reservation lives CLAIM_TTL_MS: a gateway
        that dies (or loses Redis) before the push strands the id for seconds, not for --request-ttl.
        The claim names the tenant: only its keys may read, resume or cancel the request (`owner`)."""
        token = owner_claim(tenant, uuid.uuid4().hex)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self._claim_key(request_id), token, nx=True, px=CLAIM_TTL_MS)
            pipe.exists(self.names.events(request_id), self.names.job(request_id))
            claimed, existing = await pipe.execute()
        return token if claimed and not existing else None

    async def release(self, request_id: str, token: str) -> None:
        """Undo a claim whose job was never pushed (best effort: it expires within seconds anyway)."""
        await self._release_claim(keys=[self._claim_key(request_id)], args=[token])

    async def push(self, job: dict[str, Any], claim: str) -> Placement:
        """Queue a job (already checked with protocol.parse_job, its id claimed with `claim`) where the
        router sends it, recording its entry as the owner of the id (`job:{id}`, as workers do when
        they read it), in one script that first checks the claim is still this push's and makes it
        last --request-ttl: no moment exists where the id is taken and no job holds it (on a single
        Redis; a cluster checks the claim in its own slot first, then pushes as any client does).
        ProtocolError `duplicate_id` when another request took the id. Returns where it waits."""
        rid = job["id"]
        ((field_name, payload), ) = encode_job(job, "json").items()
        route = await self.router.route(job)
        guard = ([self._claim_key(rid), self.names.events(rid)], [claim, self.ttl_ms])
        # The guard's own keys and arguments sit after SUBMIT_SCRIPT's: the check alone pads those.
        job_key = self.names.job(rid)
        if self.names.cluster and not await self._claim_held(keys=[job_key, job_key, job_key, *guard[0]],
                                                             args=["", "", "", "", "", *guard[1]]):
            raise ProtocolError("duplicate_id", f"id {rid!r} is already used by another request", rid)
        placement = await push_job(self.redis, self.names, self._submit, route, rid, field_name, payload, guard)
        self.metrics.inc("requests_total")
        self.metrics.routed(route.outcome)
        return placement

    async def statuses(self, jobs: dict[str, Placement | None]) -> dict[str, JobStatus]:
        """Where each job is now: queued (at which place), or its prompt's progress."""
        return await job_statuses(self.redis, self.names, jobs)

    async def backlog(self) -> int:
        """Entries on the request streams: jobs no worker has read yet plus those being served."""
        streams = await all_streams(self.redis, self.names)
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
            return sum(await pipe.execute())

    async def save_stream_meta(self, request_id: str, text: str) -> None:
        await self.redis.set(self.names.openai_stream(request_id), text, px=self.ttl_ms)

    async def drop_stream_meta(self, request_id: str) -> None:
        await self.redis.delete(self.names.openai_stream(request_id))

    async def stream_meta(self, request_id: str) -> bytes | None:
        return await self.redis.get(self.names.openai_stream(request_id))

    async def owner(self, request_id: str) -> bytes | None:
        """The claim on the id, naming the tenant whose request it is (tenants.may_access)."""
        return await self.redis.get(self._claim_key(request_id))

    async def known(self, request_id: str) -> bool:
        """A job was pushed with this id (and its keys live): a claim alone is not a request, so a
        resume of an id whose push never happened is `unknown_request` at once."""
        return bool(await self.redis.exists(self.names.events(request_id), self.names.job(request_id)))

    async def last_event(self, request_id: str) -> dict[str, Any] | None:
        entries = await self.redis.xrevrange(self.names.events(request_id), count=1)
        if not entries:
            return None
        try:
            event = decode_payload(*split_fields(entries[0][1]))
        except ProtocolError:
            return None
        return event if isinstance(event, dict) else None

    async def announce_resume(self, request_id: str) -> None:
        """Every gateway's grace cancel of this request stops: a live one hears it now, one that has not
        started yet finds the time of the resume in Redis (`resumed_since`)."""
        await self.redis.set(self.names.gateway_resumed(request_id), int(time.time() * 1000), px=self.ttl_ms)
        await self.redis.publish(self.relay.resumed_channel, request_id)

    async def resumed_since(self, request_id: str, since_ms: float) -> bool:
        """Whether some gateway resumed the request at or after `since_ms` (wall clock, ms)."""
        when = await self.redis.get(self.names.gateway_resumed(request_id))
        return when is not None and int(when) > since_ms

    async def cancel(self, request_id: str) -> None:
        """The marker covers a job no worker has read yet; the message reaches the one running it.
        An id nobody submitted (or whose keys expired) gets ProtocolError `unknown_request`, and no key."""
        keys = [self.names.cancelled(request_id), self.names.job(request_id), self.names.events(request_id)]
        if not await self._cancel_known(keys=keys, args=[self.names.cancel, request_id, self.ttl_ms]):
            raise ProtocolError("unknown_request", f"no request {request_id!r} to cancel (never submitted, "
                                "or expired)", request_id)
        self.metrics.inc("cancels_total")

    # --- health ----------------------------------------------------------------------------------

    async def ping(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), timeout=2))
        except (TimeoutError, *TRANSIENT):
            return False

    async def workers(self) -> list[dict[str, str]]:
        """Live workers and their stats (clients/heartbeats.py): never a scan of the keyspace."""
        return await live_worker_stats(self.redis, self.names, self._live_workers)
