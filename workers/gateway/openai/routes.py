"""The OpenAI-compatible API on the gateway's port (docs/openai.md): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (whole or as Server-Sent Events) and `/v1/streams/{id}` (resume).

Requests become protocol v1 jobs on the same Redis path as `/ws` frames, so every worker serves every
protocol. Every SSE event carries `id: <request id>:<seq>`, the position in the request's durable
events stream: a client that reconnects with `Last-Event-ID` gets the rest, with no gap and no
duplicate, from any gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clients.backoff import TRANSIENT
from clients.errors import ProtocolError
from clients.loras import list_all as list_loras
from clients.loras import lookup as lookup_lora
from clients.protocol import ID_RE, MAX_SESSION_CHARS, TRACEPARENT_RE
from workers.gateway.openai.answers import Answers
from workers.gateway.openai.batches import BatchRoutes
from workers.gateway.openai.embeddings import parse_embeddings
from workers.gateway.openai.file_store import RedisFileStore
from workers.gateway.openai.files import FileRoutes
from workers.gateway.openai.job_builder import build_jobs, from_protocol
from workers.gateway.openai.jobs import GatewayServices, JobStream
from workers.gateway.openai.lora_models import adapter_models, split_model
from workers.gateway.openai.request import OpenAIError, OpenAIRequest, bad, parse_chat, parse_completion
from workers.gateway.openai.response import StreamMeta
from workers.gateway.openai.responses import ResponseRoutes
from workers.gateway.openai.stream import Position, wants_resumable
from workers.gateway.openai.tokenize import TokenizeRoutes
from workers.gateway.routes import key_ok, request_token
from workers.gateway.submit import submit_jobs
from workers.gateway.tenants import RateLimited, job_id

log = logging.getLogger("streamer.gateway")
_MODELS_TTL_S = 2.0  # how long the list of served models is reused


def error_response(e: OpenAIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(e.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def rate_limit_error(e: RateLimited) -> OpenAIError:
    """429 as OpenAI answers it: `type` names the limit (requests, tokens), `code` is
    rate_limit_exceeded, and Retry-After says when to come back. A request that can never fit (more
    tokens than a minute allows) has no Retry-After and the code request_too_large."""
    kind = "tokens" if e.reason == "tokens" else "requests"
    if e.retry_after_s is None:
        return OpenAIError(429, e.message, None, "request_too_large", kind)
    return OpenAIError(429, e.message, None, "rate_limit_exceeded", kind, {"Retry-After": str(e.retry_after_s)})


class OpenAIRoutes:
    def __init__(self, gateway: GatewayServices) -> None:
        self.gw = gateway
        self._models: tuple[float, list[dict[str, str]]] = (-_MODELS_TTL_S, [])
        self._models_read: asyncio.Future[list[dict[str, str]]] | None = None
        # The Batch API (files.py, batches.py); the gateway's batch runner drives the batches.
        self.files = FileRoutes(gateway, RedisFileStore(gateway.hub.redis, gateway.hub.names))
        self.batches = BatchRoutes(gateway, self.files, self._check_model)
        self.tokens = TokenizeRoutes(gateway, self._check_model, self._json_body)  # /tokenize, /detokenize
        self.answers = Answers(gateway)  # SSE or whole, and their resume
        self.responses = ResponseRoutes(gateway, self, rate_limit_error)  # /v1/responses

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self._guard(self.models), methods=["GET"]),
                Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
                Route("/v1/embeddings", self._guard(self.embeddings), methods=["POST"]),
                Route("/v1/streams/{request_id:path}", self._guard(self.answers.resume), methods=["GET"]),
                *self.files.routes(self._guard), *self.batches.routes(self._guard),
                *self.tokens.routes(self._guard), *self.responses.routes(self._guard)]

    def _guard(self, handler: Any) -> Any:
        """API key first; every failure answered in OpenAI's error shape."""
        async def endpoint(request: Request) -> Response:
            if not key_ok(request, self.gw.config.api_keys):
                return error_response(OpenAIError(401, "Incorrect or missing API key: send `Authorization: "
                                                  "Bearer KEY`", None, "invalid_api_key",
                                                  headers={"WWW-Authenticate": 'Bearer realm="streamer"'}))
            try:
                return await handler(request)
            except OpenAIError as e:
                return error_response(e, request.headers.get("x-request-id"))
            except TRANSIENT as e:
                self.gw.metrics.inc("redis_errors_total")
                log.warning("OpenAI API: Redis unavailable: %r", e)
                return error_response(OpenAIError(503, "the gateway cannot reach Redis right now; retry shortly",
                                                  None, "redis_unavailable", "server_error", {"Retry-After": "1"}))
        return endpoint

    # --- models ------------------------------------------------------------------------------------

    async def served(self) -> list[dict[str, str]]:
        """Live workers' heartbeats, reused for a moment: a busy API must not read them per request,
        and a burst arriving when they are stale shares one read."""
        when, workers = self._models
        if time.monotonic() - when <= _MODELS_TTL_S:
            return workers
        if self._models_read is None or self._models_read.done():
            self._models_read = asyncio.ensure_future(self.gw.hub.workers())
        workers = await asyncio.shield(self._models_read)
        self._models = (time.monotonic(), workers)
        return workers

    async def models(self, request: Request) -> Response:
        names: dict[str, dict[str, Any]] = {}
        for w in await self.served():
            name = w.get("served_model_name") or w.get("model") or "default"
            names.setdefault(name, {"id": name, "object": "model", "created": int(self.gw.started_wall),
                                    "owned_by": "streamer", "root": w.get("model") or name,
                                    "max_model_len": int(w.get("max_model_len") or 0) or None})
        adapters = adapter_models(await list_loras(self.gw.hub.redis, self.gw.hub.names), sorted(names),
                                  int(self.gw.started_wall))
        return JSONResponse({"object": "list", "data": [*names.values(), *adapters]})

    async def _check_model(self, model: str) -> str | None:
        """The LoRA adapter the model name asks for (None: the base model); 404 for a name neither
        served nor registered."""
        workers = await self.served()
        known = {w.get(k) for w in workers for k in ("served_model_name", "model")} - {None, ""}
        _, adapter = split_model(model, known)
        if adapter is not None:
            if await lookup_lora(self.gw.hub.redis, self.gw.hub.names, adapter) is not None:
                return adapter
            if model != adapter:  # BASE:ADAPTER with a served base: the adapter is what is missing
                raise OpenAIError(404, f"The model `{model}` does not exist: no LoRA adapter `{adapter}` is "
                                  "registered (`streamer lora list`)", "model", "model_not_found")
        if workers and model not in known:  # no live worker: the job waits in the queue for one
            raise OpenAIError(404, f"The model `{model}` does not exist. Served: {sorted(known)}", "model",
                              "model_not_found")
        return None

    # --- completions -------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, parse_chat)

    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, parse_embeddings)  # openai/embeddings.py

    async def _serve(self, request: Request, parse: Any) -> Response:
        last_event_id = request.headers.get("last-event-id")
        if last_event_id:  # a reconnecting SSE client: the same stream, not a new job
            rid, _, after = last_event_id.rpartition(":")
            return await self.answers.resume_at(request, rid, after)
        body = await self._json_body(request)
        req = parse(body)
        lora = await self._check_model(req.model)
        await self._check_backlog()
        meta = StreamMeta(self._request_id(request), req.kind, req.model, int(time.time()), req.n, [],
                          req.include_usage, req.top_logprobs, req.encoding_format)
        tenant = self.gw.config.tenant_of(request_token(request))  # _guard checked the key
        jobs = self._jobs(req, meta, tenant, _session(request, req), lora)
        carried = request.headers.get("traceparent", "")
        if TRACEPARENT_RE.match(carried):  # W3C: one that cannot be read is ignored (a new trace)
            for job in jobs:
                job["traceparent"] = carried
        try:
            stream = await self._submit(meta, jobs, tenant)
        except RateLimited as e:
            raise rate_limit_error(e) from e
        if req.stream:
            return self.answers.sse(meta, stream, Position.start(), fresh=True,
                                    resumable=wants_resumable(request.headers))
        return await self.answers.whole(request, meta, stream)

    async def _json_body(self, request: Request) -> Any:
        limit = self.gw.config.max_frame_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"the request body is over {limit} bytes", None, "too_large")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise OpenAIError(413, f"the request body is over {limit} bytes", None, "too_large")
        try:
            return json.loads(data, parse_constant=_no_constants)
        except (ValueError, RecursionError) as e:
            raise bad(f"the request body is not valid JSON: {e}"[:300], None, "bad_json") from e

    async def _check_backlog(self) -> None:
        limit = self.gw.config.max_queued_jobs
        if limit > 0 and await self.gw.hub.backlog() >= limit:
            raise OpenAIError(429, f"the queue is full ({limit} jobs waiting or running); retry later", None,
                              "queue_full", "rate_limit_error", {"Retry-After": "2"})

    def _request_id(self, request: Request) -> str:
        given = request.headers.get("x-request-id")
        if given is None:
            return uuid.uuid4().hex
        # Job ids of a request with several prompts add `.N`; leave room for it.
        if not ID_RE.match(given) or len(given) > 120:
            raise bad("X-Request-Id must be 1-120 characters from A-Z a-z 0-9 . _ : @ / + = -", "X-Request-Id")
        return given

    def _jobs(self, req: OpenAIRequest, meta: StreamMeta, tenant: str = "",
              session: str | None = None, lora: str | None = None) -> list[dict[str, Any]]:
        jobs = build_jobs(self.gw, req, meta.request_id, tenant, session, lora)
        meta.jobs = [job["id"] for job in jobs]
        return jobs

    async def _submit(self, meta: StreamMeta, jobs: list[dict[str, Any]], tenant: str = "") -> JobStream:
        hub = self.gw.hub
        stream = JobStream(self.gw, meta)

        async def subscribe() -> None:
            await hub.save_stream_meta(job_id(tenant, meta.request_id), meta.dumps())
            await stream.watch(0, catch_up=False)  # subscribed before the jobs exist: no token is missed
            stream.pushed_at = time.monotonic()  # before the push: a token can arrive before it returns

        async def undo() -> None:
            stream.close(cancel=False)
            await hub.drop_stream_meta(job_id(tenant, meta.request_id))

        try:
            await submit_jobs(hub, self.gw.gate, tenant, jobs, self.gw.prompt_limit(), subscribe, undo)
        except RateLimited:
            raise
        except ProtocolError as e:
            if e.code != "duplicate_id":
                raise from_protocol(e) from e
            raise OpenAIError(409, f"request id {meta.request_id!r} is already in use", "X-Request-Id",
                              "duplicate_id") from e
        return stream


def _session(request: Request, req: OpenAIRequest) -> str | None:
    """The jobs' `session`: the X-Session-Id header, else the body's `user` (None: neither)."""
    header = request.headers.get("x-session-id")
    if header is not None:
        if not 0 < len(header) <= MAX_SESSION_CHARS:
            raise bad(f"X-Session-Id must be 1 to {MAX_SESSION_CHARS} characters", "X-Session-Id")
        return header
    if req.user is not None and len(req.user) > MAX_SESSION_CHARS:
        raise bad(f"`user` must be at most {MAX_SESSION_CHARS} characters", "user")
    return req.user or None  # "" is no user


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
