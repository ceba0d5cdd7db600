"""`/tokenize` and `/detokenize` with vLLM's request and response shapes (docs/openai.md). The gateway
holds no tokenizer: each request is a job on the queue like any other (`task` tokenize or detokenize,
clients/protocol.py), answered by a worker's tokenizer without entering its batch."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clients.errors import ProtocolError
from clients.protocol import VERSION
from workers.gateway.admission import check_job
from workers.gateway.openai.job_builder import from_protocol
from workers.gateway.openai.jobs import GatewayServices, JobStream
from workers.gateway.openai.request import OpenAIError, bad, check_fields
from workers.gateway.openai.response import StreamMeta
from workers.gateway.routes import request_token
from workers.gateway.submit import submit_jobs
from workers.gateway.tenants import RateLimited, job_id, tag

_TEXT_OPTIONS = {"add_special_tokens", "return_token_strs"}
_CHAT_OPTIONS = _TEXT_OPTIONS | {"add_generation_prompt", "continue_final_message"}
TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools"} | _CHAT_OPTIONS
DETOKENIZE_FIELDS = {"model", "tokens"}
CheckModel = Callable[[str], Awaitable[Any]]
JsonBody = Callable[[Request], Awaitable[Any]]


def tokenize_job(body: Any) -> dict[str, Any]:
    """The job of a /tokenize body: a `prompt`, or `messages` (and `tools`) through the chat template."""
    body = check_fields(body, TOKENIZE_FIELDS)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise bad("give exactly one of `prompt` or `messages`", "prompt")
    allowed = _CHAT_OPTIONS if chat else _TEXT_OPTIONS
    options = {k: body[k] for k in _CHAT_OPTIONS if k in body and body[k] is not None}
    for name, value in options.items():
        if name not in allowed:
            raise bad(f"`{name}` applies to `messages` only", name)
        if not isinstance(value, bool):
            raise bad(f"`{name}` must be a boolean", name)
    job: dict[str, Any] = {"task": "tokenize", "options": options}
    if chat:
        job["messages"] = body["messages"]
        if body.get("tools") is not None:
            job["tools"] = body["tools"]
    elif not isinstance(body["prompt"], str):
        raise bad("`prompt` must be a string", "prompt")
    else:
        job["prompt"] = body["prompt"]
    return job


def detokenize_job(body: Any) -> dict[str, Any]:
    body = check_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise bad("`tokens` must be a non-empty list of token ids", "tokens")
    return {"task": "detokenize", "prompt_token_ids": tokens}


class TokenizeRoutes:
    def __init__(self, gw: GatewayServices, check_model: CheckModel, json_body: JsonBody) -> None:
        self.gw, self.check_model, self.json_body = gw, check_model, json_body

    def routes(self, guard: Any) -> list[Route]:
        return [Route("/tokenize", guard(self.tokenize), methods=["POST"]),
                Route("/detokenize", guard(self.detokenize), methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        body = await self.json_body(request)
        result = await self._run(request, body, tokenize_job(body))
        return JSONResponse({"count": result["count"], "max_model_len": result["max_model_len"],
                             "tokens": result["tokens"], "token_strs": result.get("token_strs")})

    async def detokenize(self, request: Request) -> Response:
        body = await self.json_body(request)
        return JSONResponse({"prompt": (await self._run(request, body, detokenize_job(body)))["prompt"]})

    async def _run(self, request: Request, body: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        """Push the task's job and wait for its answer (a `done` event with a `result`)."""
        await self.check_model(body["model"])
        tenant = self.gw.config.tenant_of(request_token(request))
        request_id = uuid.uuid4().hex
        job = tag({"v": VERSION, "id": job_id(tenant, request_id), **fields}, tenant)
        try:
            check_job(job, self.gw.limits, self.gw.prompt_limit())
        except ProtocolError as e:
            raise from_protocol(e) from e
        stream = JobStream(self.gw, StreamMeta(request_id, "tokenize", body["model"], int(time.time()), 1,
                                               [job["id"]]))

        async def subscribe() -> None:
            await stream.watch(0, catch_up=False)

        async def undo() -> None:
            stream.close(cancel=False)

        try:
            await submit_jobs(self.gw.hub, self.gw.gate, tenant, [job], self.gw.prompt_limit(), subscribe, undo)
            async for _, event in stream.events():
                if event.get("type") == "error":
                    raise OpenAIError(400, event.get("message", "failed"), None, event.get("code"))
                if event.get("type") == "done":
                    return event["result"]
        except RateLimited as e:
            retry = {} if e.retry_after_s is None else {"Retry-After": str(e.retry_after_s)}
            raise OpenAIError(429, e.message, None, e.code, "rate_limit_error", retry) from e
        except ProtocolError as e:
            raise from_protocol(e) from e
        finally:
            stream.close(cancel=True)
        raise OpenAIError(500, "the worker ended the request without an answer", None, "internal", "server_error")
