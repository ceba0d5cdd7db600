"""What the OpenAI API needs of the gateway (`GatewayServices`, a Protocol that server.py's `Gateway` meets),
and one request's jobs as a single stream of events (`JobStream`): watched before the jobs exist,
relayed in each job's seq order, and handed to the grace-period cancel when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from clients.errors import ProtocolError
from clients.protocol import Limits
from workers.gateway.config import GatewayConfig
from workers.gateway.hub import Hub
from workers.gateway.metrics import Metrics
from workers.gateway.openai.response import StreamMeta
from workers.gateway.tenants import TenantGate


class GatewayServices(Protocol):
    """What the API needs of the gateway that serves it (server.py's `Gateway`)."""

    config: GatewayConfig
    hub: Hub
    metrics: Metrics
    limits: Limits
    gate: TenantGate  # the tenants' limits, checked before the jobs are pushed
    started_wall: float
    http_streams: dict[str, int]  # request id -> HTTP streams relaying it now
    draining: asyncio.Event  # set when the gateway starts shutting down
    sse_streams: set[JobStream]  # the streams relayed as SSE now, ended at once on shutdown
    workers_max_model_len: int  # the longest context a live worker announces (0: none has)

    def prompt_limit(self) -> int: ...

    def keep(self, request_id: str) -> None:
        """Resumed: no grace-period cancel for it."""
        ...

    def cancel_later(self, request_id: str, since_ms: float) -> None:
        """Its client went away: cancel it after the grace period unless someone resumes it."""
        ...


# What events() ends with when the gateway shuts down while the stream is open (end_now).
SHUTDOWN: dict[str, Any] = {"type": "shutdown"}


class JobStream:
    """The events of one OpenAI request's jobs, as (job index, event) in each job's seq order."""

    def __init__(self, gw: GatewayServices, meta: StreamMeta) -> None:
        self.gw, self.meta = gw, meta
        self.queue: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        self.watches: dict[str, Any] = {}
        self.finished: set[str] = set()
        # When its jobs were pushed (time.monotonic()); None for a resumed stream, which has no first
        # token to time.
        self.pushed_at: float | None = None

    async def watch(self, next_seq: int, *, catch_up: bool) -> None:
        for job, rid in enumerate(self.meta.jobs):
            def on_event(event: dict[str, Any], _text: str, job: int = job, rid: str = rid) -> None:
                if event.get("type") in ("done", "error"):
                    self.finished.add(rid)
                self.queue.put_nowait((job, event))

            self.watches[rid] = await self.gw.hub.relay.watch(rid, next_seq, on_event)
            self.gw.http_streams[rid] = self.gw.http_streams.get(rid, 0) + 1
            if catch_up:
                await self.gw.hub.relay.fill(self.watches[rid])

    def end_now(self) -> None:
        """The gateway shuts down: events() ends with SHUTDOWN after the events already here, so the
        client hears why at once instead of its connection being cut when the server gives up."""
        self.queue.put_nowait((-1, SHUTDOWN))

    async def events(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        remaining = len(self.meta.jobs)
        while remaining:
            job, event = await self.queue.get()
            if event is SHUTDOWN:
                yield job, event
                return
            if event.get("type") != "token":
                remaining -= 1
            yield job, event

    async def relayed(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """events(), timing the first token of a fresh stream as it is handed to the client (of any of
        the request's jobs: the client sees one answer)."""
        async for job, event in self.events():
            if self.pushed_at is not None and event.get("type") == "token":
                self.gw.metrics.first_token("openai", self.pushed_at)
                self.pushed_at = None
            yield job, event

    async def cancel_unfinished(self) -> None:
        for rid in self.watches:
            if rid not in self.finished:
                with contextlib.suppress(ProtocolError):  # its keys expired meanwhile
                    await self.gw.hub.cancel(rid)

    def close(self, *, cancel: bool) -> None:
        """Stop relaying; a job left unfinished is cancelled after the grace period unless resumed."""
        for rid, w in self.watches.items():
            self.gw.hub.relay.unwatch(w)
            count = self.gw.http_streams.get(rid, 1) - 1
            if count > 0:
                self.gw.http_streams[rid] = count
            else:
                self.gw.http_streams.pop(rid, None)
            if cancel and rid not in self.finished:
                self.gw.cancel_later(rid, w.started_ms)
        self.watches.clear()
