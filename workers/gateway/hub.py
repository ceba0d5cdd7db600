"""The gateway's Redis side: push jobs, cancel them, track their ids; the events each request
gets are relayed by relay.py's EventRelay, which the hub owns.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
from workers.redis_options import async_client

log = logging.getLogger("streamer.gateway")


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
        self._submit = self.redis.register_script(SUBMIT_SCRIPT)
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
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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
        """Set by the gateway when it pushes a job: duplicate ids are refused before they reach a worker,
        and a resume of a job still waiting in the queue (no events yet) is told apart from a typo."""
        return self.names.gateway_claim(request_id)

    async def claim(self, request_id: str) -> bool:
        """Reserve an id for a job this gateway is about to push. False if it is already in use."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self._claim_key(request_id), 1, nx=True, px=self.ttl_ms)
            pipe.exists(self.names.events(request_id), self.names.job(request_id))
            claimed, existing = await pipe.execute()
        return bool(claimed) and not existing

    async def release(self, request_id: str) -> None:
        """Undo a claim whose job was never pushed (best effort: it expires anyway)."""
        await self.redis.delete(self._claim_key(request_id))

    async def push(self, job: dict[str, Any]) -> Placement:
        """Queue a job (already checked with protocol.parse_job, its id claimed) where the router sends
        it, recording its entry as the owner of the id (`job:{id}`, as workers do when they read it).
        Returns where it waits, for `statuses`."""
        ((field_name, payload),) = encode_job(job, "json").items()
        route = await self.router.route(job)
        placement = await push_job(self.redis, self.names, self._submit, route, job["id"], field_name, payload)
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

    async def known(self, request_id: str) -> bool:
        keys = (self._claim_key(request_id), self.names.events(request_id), self.names.job(request_id))
        return bool(await self.redis.exists(*keys))

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
        keys = [self.names.cancelled(request_id), self._claim_key(request_id), self.names.job(request_id),
                self.names.events(request_id)]
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
