"""`/v1/batches` (docs/openai.md): create a batch from an uploaded JSONL file, retrieve, list, cancel.

A batch is checked whole when created: every line must be a request the live endpoint would accept
(the same parsing, request.py, and the same job building, job_builder.py), or the batch is created
`failed` with the lines' errors, as OpenAI does. Its lines become ordinary jobs in the batch lane
(clients/names.py BATCH_PRIORITY), pushed and collected by the gateways' batch runner
(batch_runner.py); its state lives in Redis (batch_store.py), so any gateway answers for it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clients.names import BATCH_PRIORITY
from workers.gateway.openai.batch_store import TERMINAL, WINDOW_S, BatchStore
from workers.gateway.openai.embeddings import parse_embeddings
from workers.gateway.openai.files import FileRoutes, not_found
from workers.gateway.openai.job_builder import build_jobs
from workers.gateway.openai.jobs import GatewayServices
from workers.gateway.openai.request import OpenAIError, bad, parse_chat, parse_completion
from workers.gateway.openai.response import StreamMeta
from workers.gateway.routes import request_token

ENDPOINTS = {"/v1/chat/completions": ("chat", parse_chat), "/v1/completions": ("completion", parse_completion),
             "/v1/embeddings": ("embedding", parse_embeddings)}
MAX_LINES = 50_000  # OpenAI's bound on one batch
MAX_ERRORS = 100  # line errors reported for a batch that fails validation


class BatchRoutes:
    def __init__(self, gw: GatewayServices, files: FileRoutes,
                 check_model: Callable[[str], Awaitable[str | None]]) -> None:
        self.gw, self.files, self.check_model = gw, files, check_model
        self.store = BatchStore(gw.hub.redis, gw.hub.names)

    def routes(self, guard: Any) -> list[Route]:
        return [Route("/v1/batches", guard(self.create), methods=["POST"]),
                Route("/v1/batches", guard(self.list), methods=["GET"]),
                Route("/v1/batches/{batch_id}", guard(self.retrieve), methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", guard(self.cancel), methods=["POST"])]

    def _tenant(self, request: Request) -> str:
        return self.gw.config.tenant_of(request_token(request))

    async def create(self, request: Request) -> Response:
        declared, limit = request.headers.get("content-length", ""), self.gw.config.max_frame_bytes
        if declared.isdigit() and int(declared) > limit:  # the lines are in the file, not in this body
            raise OpenAIError(413, f"the request body is over {limit} bytes", None, "too_large")
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise bad(f"the request body is not valid JSON: {e}"[:300], None, "bad_json") from e
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad(f"`endpoint` must be one of {sorted(ENDPOINTS)}", "endpoint")
        if body.get("completion_window") != "24h":
            raise bad("`completion_window` must be \"24h\"", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise bad("`metadata` must be an object of at most 16 string values", "metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad("`input_file_id` is required", "input_file_id")
        meta = await self.files.owned(request, file_id)
        if meta.purpose != "batch":
            raise bad(f"file {file_id} was not uploaded with purpose \"batch\"", "input_file_id")
        content = await self.files.store.content(file_id)
        if content is None:
            raise not_found(file_id)
        now, tenant = int(time.time()), self._tenant(request)
        batch_id = f"batch_{uuid.uuid4().hex}"
        lines, errors = await self._lines(batch_id, endpoint, content, tenant, now)
        fixed = {"id": batch_id, "endpoint": endpoint, "input_file_id": file_id, "completion_window": "24h",
                 "created_at": now, "expires_at": now + WINDOW_S, "metadata": metadata, "tenant": tenant,
                 "total": 0 if errors else len(lines)}
        if errors:
            await self.store.create(fixed, [], "failed", {"object": "list", "data": errors[:MAX_ERRORS]})
        else:
            await self.files.store.extend(file_id, now + 2 * WINDOW_S)  # as long as the batch is kept
            await self.store.create(fixed, [json.dumps(x) for x in lines], "validating")
        return await self._answer(batch_id)

    async def _lines(self, batch_id: str, endpoint: str, content: bytes, tenant: str,
                     now: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Each line's jobs and how to format its answer, or the lines' errors (OpenAI's shape)."""
        kind, parse = ENDPOINTS[endpoint]
        lines: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        models: dict[str, str | None] = {}  # model name -> its LoRA adapter, checked once per name
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            return [], [{"code": "invalid_json_line", "message": "the file is not UTF-8", "param": None,
                         "line": None}]
        rows = [(n, row) for n, row in enumerate(text.splitlines(), 1) if row.strip()]
        if not rows:
            return [], [{"code": "empty_file", "message": "the input file has no requests", "param": None,
                         "line": None}]
        if len(rows) > MAX_LINES:
            return [], [{"code": "too_many_requests", "message": f"at most {MAX_LINES} requests in a batch",
                         "param": None, "line": None}]
        for number, row in rows:
            try:
                item = json.loads(row)
                if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str) or not item["custom_id"]:
                    raise bad("each line must be an object with a non-empty string `custom_id`", "custom_id")
                if item["custom_id"] in seen:
                    raise bad(f"custom_id {item['custom_id']!r} is used by more than one line", "custom_id",
                              "duplicate_custom_id")
                if item.get("method") != "POST" or item.get("url") != endpoint:
                    raise bad(f"each line's method must be POST and its url {endpoint} (the batch's endpoint)",
                              "url", "mismatched_endpoint")
                req = parse(item.get("body"))
                if req.stream:
                    raise bad("`stream` is not allowed in a batch", "body.stream")
                if req.model not in models:
                    models[req.model] = await self.check_model(req.model)
                request_id = f"{batch_id}.{len(lines)}"
                jobs = build_jobs(self.gw, req, request_id, tenant, req.user or None, models[req.model],
                                  priority=BATCH_PRIORITY)
            except ValueError as e:
                errors.append({"code": "invalid_json_line", "message": f"line {number} is not JSON: {e}"[:300],
                               "param": None, "line": number})
                continue
            except OpenAIError as e:
                errors.append({"code": e.code or "invalid_request", "message": e.message, "param": e.param,
                               "line": number})
                continue
            seen.add(item["custom_id"])
            meta = StreamMeta(request_id, kind, req.model, now, req.n, [j["id"] for j in jobs], False,
                              req.top_logprobs, req.encoding_format)
            lines.append({"custom_id": item["custom_id"], "jobs": jobs, "meta": json.loads(meta.dumps())})
        return lines, errors

    async def _owned(self, request: Request, batch_id: str) -> dict[str, Any]:
        obj = await self.store.public(batch_id)
        if obj is None or obj.pop("_tenant") != self._tenant(request):
            raise OpenAIError(404, f"No batch found with id '{batch_id}'", "batch_id", "not_found")
        return obj

    async def _answer(self, batch_id: str) -> Response:
        obj = await self.store.public(batch_id)
        assert obj is not None, "just written"
        obj.pop("_tenant")
        return JSONResponse(obj)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self._owned(request, request.path_params["batch_id"]))

    async def cancel(self, request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        obj = await self._owned(request, batch_id)
        if obj["status"] in ("cancelling", "cancelled"):
            return JSONResponse(obj)
        # The runner sees `cancelling`, cancels the lines' jobs still running and ends it `cancelled`.
        if not await self.store.move(batch_id, "cancelling", "validating", "in_progress"):
            status = (await self._owned(request, batch_id))["status"]
            if status in TERMINAL or status == "finalizing":
                raise OpenAIError(409, f"Cannot cancel a batch with status '{status}'", "batch_id",
                                  "batch_not_cancellable")
        return JSONResponse(await self._owned(request, batch_id))

    async def list(self, request: Request) -> Response:
        q = request.query_params
        limit_text = q.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise bad("`limit` must be an integer from 1 to 100", "limit")
        limit = int(limit_text)
        ids = await self.store.list(self._tenant(request), q.get("after"), limit)
        data = []
        for batch_id in ids[:limit]:
            obj = await self.store.public(batch_id)
            if obj is not None:
                obj.pop("_tenant")
                data.append(obj)
        return JSONResponse({"object": "list", "data": data, "has_more": len(ids) > limit,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})
