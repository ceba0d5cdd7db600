"""`/v1/responses` (docs/openai.md#responses-api): create (whole, streamed, or `background`), retrieve
(the object, or its event stream resumed after `starting_after`), cancel, delete.

A response is one chat job (response_input.py builds it, the chat endpoint's parser checks it, and it
is pushed on the one submit path, routes.py's `_submit`). Its Responses events are numbered from the
job's durable events (response_events.py), and the response itself is stored in Redis
(response_store.py): a stream resumed from any gateway, after a worker, gateway or Redis restart, is
the same events under the same numbers.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clients.errors import ProtocolError
from workers.gateway.openai.answers import first_of, sse_response
from workers.gateway.openai.job_builder import build_jobs
from workers.gateway.openai.jobs import SHUTDOWN, GatewayServices, JobStream
from workers.gateway.openai.request import OpenAIError, bad
from workers.gateway.openai.response import StreamMeta, worker_error
from workers.gateway.openai.response_events import FINAL_STATUSES, ResponseEvents
from workers.gateway.openai.response_input import parse_responses
from workers.gateway.openai.response_store import ResponseStore, ResponseSweeper, StoredResponse
from workers.gateway.resume import begin_resume
from workers.gateway.routes import request_token
from workers.gateway.tenants import RateLimited

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


class Api(Protocol):
    """What the Responses API uses of the OpenAI routes (routes.py's `OpenAIRoutes`)."""

    async def _json_body(self, request: Request) -> Any: ...

    async def _check_model(self, model: str) -> str | None: ...

    async def _check_backlog(self) -> None: ...

    async def _submit(self, meta: StreamMeta, jobs: list[dict[str, Any]], tenant: str = "") -> JobStream: ...


def _frame(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {_ENCODER.encode(event)}\n\n"


def not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param, "not_found")


class ResponseRoutes:
    def __init__(self, gw: GatewayServices, api: Api, rate_limit_error: Callable[[RateLimited], OpenAIError]) -> None:
        self.gw, self.api, self.rate_limit_error = gw, api, rate_limit_error
        self.store = ResponseStore(gw.hub)
        self.sweeper = ResponseSweeper(self.store)  # server.py runs it

    def routes(self, guard: Any) -> list[Route]:
        return [Route("/v1/responses", guard(self.create), methods=["POST"]),
                Route("/v1/responses/{response_id}", guard(self.retrieve), methods=["GET"]),
                Route("/v1/responses/{response_id}", guard(self.delete), methods=["DELETE"]),
                Route("/v1/responses/{response_id}/cancel", guard(self.cancel), methods=["POST"])]

    def _tenant(self, request: Request) -> str:
        return self.gw.config.tenant_of(request_token(request))

    async def _owned(self, request: Request, response_id: str, param: str = "response_id") -> StoredResponse:
        r = await self.store.load(response_id)
        if r is None or r.tenant != self._tenant(request):  # another tenant's does not exist for this key
            raise not_found(response_id, param)
        return r

    # --- create --------------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await self.api._json_body(request)
        earlier: list[dict[str, Any]] = []
        session: str | None = None
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None:
            if not isinstance(previous, str):
                raise bad("`previous_response_id` must be a string", "previous_response_id")
            prev = await self._owned(request, previous, "previous_response_id")
            before = await self.store.current(prev)
            if before["status"] not in FINAL_STATUSES:
                raise bad(f"previous response {previous!r} is still {before['status']}: continue it once it has "
                          "finished", "previous_response_id")
            earlier, session = [*prev.items, *before["output"]], prev.session
        parsed = parse_responses(body, earlier)
        req, tenant = parsed.chat, self._tenant(request)
        lora = await self.api._check_model(req.model)
        await self.api._check_backlog()
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        # The conversation's first response names its session: routing keeps its turns on the worker
        # whose prefix cache holds them. An unstored response has no follow-up to route.
        session = session or parsed.cache_key or (response_id if parsed.store else None)
        jobs = build_jobs(self.gw, req, response_id, tenant, session, lora)
        fixed = {"id": response_id, "created_at": created, **parsed.fixed}
        meta = StreamMeta(response_id, "chat", req.model, created, 1, [job["id"] for job in jobs])
        stored = StoredResponse(response_id, fixed, jobs[0]["id"], tenant, session or "", parsed.items)
        if parsed.store:  # before the push: a response that runs can always be read back
            await self.store.create(stored)
        try:
            stream = await self.api._submit(meta, jobs, tenant)
        except BaseException as e:
            if parsed.store:
                with contextlib.suppress(Exception):
                    await self.store.delete(response_id)
            if isinstance(e, RateLimited):
                raise self.rate_limit_error(e) from e
            raise
        if parsed.store:
            await self.store.activate(response_id)
        events = ResponseEvents(fixed)
        if parsed.stream:
            return self._sse(stream, events, -1, stored if parsed.store else None)
        if parsed.background:  # it runs without us; its events wait in Redis
            stream.close(cancel=False)
            return JSONResponse(events.snapshot())
        return await self._whole(request, stream, events, stored if parsed.store else None)

    async def _whole(self, request: Request, stream: JobStream, events: ResponseEvents,
                     stored: StoredResponse | None) -> Response:
        error: dict[str, Any] | None = None

        async def collect() -> None:
            nonlocal error
            events.opening()
            async for _job, event in stream.events():
                events.on_event(event)
                if event.get("type") == "error":
                    error = worker_error(event)

        try:
            outcome = await first_of(request, collect(), self.gw.draining)
            if outcome == "disconnected":
                return Response(status_code=499)  # nobody is listening; the job is cancelled below
            if outcome == "draining":
                await stream.cancel_unfinished()
                raise OpenAIError(503, "the gateway is shutting down; retry (another gateway may serve it)",
                                  None, "shutting_down", "server_error", {"Retry-After": "1"})
        finally:
            stream.close(cancel=True)
        obj = events.snapshot()
        if stored is not None:
            obj = await self.store.finish(stored, obj)
        if error is not None:  # as the chat endpoint answers a worker's error
            raise OpenAIError(500 if error["type"] == "server_error" else 400, error["message"], None,
                              error["code"], error["type"])
        return JSONResponse(obj)

    def _sse(self, stream: JobStream, events: ResponseEvents, after: int,
             stored: StoredResponse | None) -> Response:
        """The events numbered after `after`; a background response's job goes on if the client leaves."""
        async def frames() -> AsyncIterator[str]:
            for event in events.opening():
                if event["sequence_number"] > after:
                    yield _frame(event)
            async for _job, job_event in stream.relayed():
                if job_event is SHUTDOWN:  # resume it through a gateway that is up
                    yield _frame({"type": "error", "code": "shutting_down", "param": None,
                                  "message": "the gateway is shutting down: the response goes on; resume it "
                                             "(GET /v1/responses/ID?stream=true&starting_after=N) elsewhere",
                                  "sequence_number": max(after, events.next_seq - 1)})
                    return
                for event in events.on_event(job_event):
                    if event["sequence_number"] > after:
                        yield _frame(event)
                if events.finished:
                    break
            if stored is not None and events.finished:
                await self.store.finish(stored, events.snapshot())

        return sse_response(self.gw, stream, frames(), str(events.fixed["id"]),
                            cancel=not events.fixed.get("background"))

    # --- retrieve, resume, cancel, delete ------------------------------------------------------------

    async def retrieve(self, request: Request) -> Response:
        r = await self._owned(request, request.path_params["response_id"])
        query = request.query_params
        if query.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(await self.store.current(r))
        after_text = query.get("starting_after", "-1")
        try:
            after = int(after_text)
        except ValueError:
            raise bad(f"`starting_after` must be an integer: {after_text[:40]!r}", "starting_after") from None
        try:
            await begin_resume(self.gw.hub, self.gw.keep, self._tenant(request), r.job)
        except ProtocolError as e:
            raise OpenAIError(404, f"the events of response {r.id!r} expired: retrieve it without `stream`",
                              "response_id", "not_found") from e
        self.gw.metrics.inc("resumes_total")
        meta = StreamMeta(r.id, "chat", str(r.fixed["model"]), int(r.fixed["created_at"]), 1, [r.job])
        stream = JobStream(self.gw, meta)
        try:
            await stream.watch(0, catch_up=True)  # from seq 0: the numbering is rebuilt from the first event
        except BaseException:
            stream.close(cancel=False)
            raise
        return self._sse(stream, ResponseEvents(r.fixed), after, r)

    async def cancel(self, request: Request) -> Response:
        r = await self._owned(request, request.path_params["response_id"])
        if not r.fixed.get("background"):
            raise bad("Cannot cancel a synchronous response: only background responses can be cancelled",
                      "response_id")
        obj = await self.store.current(r)
        if obj["status"] in FINAL_STATUSES:  # ended already: as it ended
            return JSONResponse(obj)
        await self.store.mark_cancelled(r.id)
        await self.store.cancel_job(r)
        return JSONResponse({**obj, "status": "cancelled"})

    async def delete(self, request: Request) -> Response:
        r = await self._owned(request, request.path_params["response_id"])
        if r.final is None and (await self.store.current(r))["status"] not in FINAL_STATUSES:
            await self.store.cancel_job(r)  # nobody can read it any more: stop its work
        await self.store.delete(r.id)
        return JSONResponse({"id": r.id, "object": "response", "deleted": True})
