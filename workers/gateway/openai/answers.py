"""How an OpenAI request's pushed jobs are answered: as Server-Sent Events (a fresh stream, or one
resumed with `Last-Event-ID` or `GET /v1/streams/{id}` from any gateway), or as one JSON body once they
end; and what ends the wait early (the client going away, the gateway shutting down). The Responses
API (responses.py) streams its own events through the same `sse_response`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from clients.errors import ProtocolError
from clients.protocol import ID_RE
from workers.gateway.openai.embeddings import assembler_for
from workers.gateway.openai.jobs import GatewayServices, JobStream
from workers.gateway.openai.request import OpenAIError, bad
from workers.gateway.openai.response import Assembler, StreamMeta
from workers.gateway.openai.stream import Position, sse_events
from workers.gateway.resume import begin_resume
from workers.gateway.routes import request_token
from workers.gateway.tenants import job_id


def sse_response(gw: GatewayServices, stream: JobStream, frames: AsyncIterator[str], request_id: str,
                 cancel: bool) -> Response:
    """`frames` as an SSE response over `stream`: counted as an open stream, ended at once (after what is
    there) when the gateway is shutting down; `cancel`: whether the jobs left unfinished when it ends
    are cancelled (after the grace period, unless resumed)."""
    async def body() -> AsyncIterator[str]:
        open_streams = gw.metrics.open_connections("sse")
        open_streams.inc()
        gw.sse_streams.add(stream)
        if gw.draining.is_set():  # shutting down already: the stream ends as it starts
            stream.end_now()
        try:
            async for text in frames:
                yield text
        finally:  # finished, or the client went away (Starlette cancels the body on disconnect)
            open_streams.dec()
            gw.sse_streams.discard(stream)
            stream.close(cancel=cancel)

    headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


class Answers:
    """The chat, completions and embeddings answers (routes.py's OpenAIRoutes), and their resume."""

    def __init__(self, gw: GatewayServices) -> None:
        self.gw = gw

    def sse(self, meta: StreamMeta, stream: JobStream, after: Position, fresh: bool, resumable: bool) -> Response:
        frames = sse_events(stream.relayed(), Assembler(meta), meta, after, fresh, resumable)
        return sse_response(self.gw, stream, frames, meta.request_id, cancel=True)

    async def whole(self, request: Request, meta: StreamMeta, stream: JobStream) -> Response:
        assembler = assembler_for(meta)

        async def collect() -> None:
            async for job, event in stream.events():
                assembler.on_event(job, event)

        try:
            outcome = await first_of(request, collect(), self.gw.draining)
            if outcome == "disconnected":
                return Response(status_code=499)  # nobody is listening; the jobs are cancelled below
            if outcome == "draining":  # no resume for a whole answer: free its KV now, the client retries
                await stream.cancel_unfinished()
                raise OpenAIError(503, "the gateway is shutting down; retry (another gateway may serve it)",
                                  None, "shutting_down", "server_error", {"Retry-After": "1"})
        finally:
            stream.close(cancel=True)
        if assembler.error is not None:
            raise OpenAIError(worker_status(assembler.error["code"]), assembler.error["message"], None,
                              assembler.error["code"], assembler.error["type"])
        return JSONResponse(assembler.body(), headers={"X-Request-Id": meta.request_id})

    async def resume(self, request: Request) -> Response:
        """`GET /v1/streams/{request_id}` (`?after=` or `Last-Event-ID`: the last chunk the client has)."""
        after = request.query_params.get("after")
        last_event_id = request.headers.get("last-event-id")
        if last_event_id:  # an EventSource reconnecting to this URL: its header is the newer position
            after = last_event_id.rpartition(":")[2]
        return await self.resume_at(request, request.path_params["request_id"], after)

    async def resume_at(self, request: Request, rid: str, after: str | None) -> Response:
        position = Position.parse(after)
        if not ID_RE.match(rid):
            raise bad("not a request id of this server", "request_id")
        caller = self.gw.config.tenant_of(request_token(request))
        text = await self.gw.hub.stream_meta(job_id(caller, rid))
        if text is None:
            raise OpenAIError(404, f"no stream {rid!r} (never created, or expired)", "request_id", "unknown_request")
        meta = StreamMeta.loads(text)
        if len(meta.jobs) != 1:
            raise bad("only a request with one prompt can be resumed", "request_id")
        rid = meta.jobs[0]  # its id in Redis (a tenant's is namespaced)
        try:
            point = await begin_resume(self.gw.hub, self.gw.keep, caller, rid)
            point.check_position(position.seq)
        except ProtocolError as e:
            # Another tenant's request is answered as if it did not exist: its id tells a stranger nothing.
            if e.code == "unknown_request":
                raise OpenAIError(404, f"no stream {rid!r} (expired)", "request_id", "unknown_request") from e
            raise bad(e.message, "Last-Event-ID") from e
        self.gw.metrics.inc("resumes_total")
        stream = JobStream(self.gw, meta)
        try:
            await stream.watch(0, catch_up=True)  # from seq 0: the assembler rebuilds the first run's state
        except BaseException:
            stream.close(cancel=True)
            raise
        return self.sse(meta, stream, position, fresh=False, resumable=True)


def worker_status(code: str) -> int:
    """The HTTP status of an answer that ends with a worker's error `code`."""
    if code in ("internal", "crashed_worker", "too_many_deliveries", "damaged_events"):
        return 500
    return 504 if code == "expired" else 400


async def first_of(request: Request, work: Any, draining: asyncio.Event) -> str:
    """Run `work` to its end ("done", or its exception) unless the client disconnects ("disconnected")
    or the gateway starts shutting down ("draining") first."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    tasks = {"done": asyncio.ensure_future(work), "disconnected": asyncio.ensure_future(disconnected()),
             "draining": asyncio.ensure_future(draining.wait())}
    try:
        finished, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
        if tasks["done"] in finished:
            tasks["done"].result()  # its exception, if it failed
            return "done"
        return "disconnected" if tasks["disconnected"] in finished else "draining"
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
