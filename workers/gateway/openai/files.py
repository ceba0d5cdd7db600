"""`/v1/files` (docs/openai.md): upload (multipart, as the SDK sends it), retrieve, list, delete and
content, each tenant seeing only its own files. Files go to the store (file_store.py), bounded by
`max_file_bytes` (413 past it)."""

from __future__ import annotations

import time
import uuid
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.gateway.openai.file_store import RedisFileStore, StoredFile
from workers.gateway.openai.jobs import GatewayServices
from workers.gateway.openai.request import OpenAIError, bad
from workers.gateway.routes import request_token

# An uploaded file a batch does not use is kept one batch window; a batch extends its input file to
# its own end (batches.py).
UPLOAD_TTL_S = 24 * 3600
PURPOSES = ("batch",)


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", "id", "not_found")


class FileRoutes:
    def __init__(self, gw: GatewayServices, store: RedisFileStore) -> None:
        self.gw, self.store = gw, store

    def routes(self, guard: Any) -> list[Route]:
        return [Route("/v1/files", guard(self.create), methods=["POST"]),
                Route("/v1/files", guard(self.list), methods=["GET"]),
                Route("/v1/files/{file_id}", guard(self.retrieve), methods=["GET"]),
                Route("/v1/files/{file_id}", guard(self.delete), methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", guard(self.content), methods=["GET"])]

    def _tenant(self, request: Request) -> str:
        return self.gw.config.tenant_of(request_token(request))

    async def owned(self, request: Request, file_id: str) -> StoredFile:
        """The caller's file; another tenant's is answered as if it did not exist."""
        meta = await self.store.meta(file_id)
        if meta is None or meta.tenant != self._tenant(request):
            raise not_found(file_id)
        return meta

    async def create(self, request: Request) -> Response:
        fields = await self._fields(request)
        purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace")
        if purpose not in PURPOSES:
            raise bad(f"`purpose` must be one of {list(PURPOSES)}", "purpose")
        if "file" not in fields:
            raise bad("a `file` part is required (multipart/form-data)", "file")
        filename, content = fields["file"]
        now = int(time.time())
        meta = StoredFile(f"file-{uuid.uuid4().hex}", len(content), now, filename or "upload.jsonl", purpose,
                          now + UPLOAD_TTL_S, self._tenant(request))
        await self.store.put(meta, content)
        return JSONResponse(meta.public())

    async def _fields(self, request: Request) -> dict[str, tuple[str | None, bytes]]:
        limit = self.gw.config.max_file_bytes
        too_large = OpenAIError(413, f"the file is over this server's limit of {limit} bytes", "file",
                                "file_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + 64 * 1024:  # room for the multipart framing
            raise too_large
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit + 64 * 1024:
                raise too_large
        fields = _multipart(request.headers.get("content-type", ""), bytes(data))
        if len(fields.get("file", (None, b""))[1]) > limit:
            raise too_large
        return fields

    async def list(self, request: Request) -> Response:
        q = request.query_params
        limit = _limit(q.get("limit"), 10000)
        purpose = q.get("purpose")
        files = await self.store.list(self._tenant(request), newest_first=q.get("order", "desc") != "asc",
                                      after=q.get("after"), limit=limit)
        files = [f for f in files if purpose is None or f.purpose == purpose]
        data = [f.public() for f in files[:limit]]
        return JSONResponse({"object": "list", "data": data, "has_more": len(files) > limit,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse((await self.owned(request, request.path_params["file_id"])).public())

    async def delete(self, request: Request) -> Response:
        meta = await self.owned(request, request.path_params["file_id"])
        await self.store.delete(meta)
        return JSONResponse({"id": meta.id, "object": "file", "deleted": True})

    async def content(self, request: Request) -> Response:
        meta = await self.owned(request, request.path_params["file_id"])
        content = await self.store.content(meta.id)
        if content is None:  # expired between the two reads
            raise not_found(meta.id)
        return Response(content, media_type="application/octet-stream")


def _limit(value: str | None, most: int) -> int:
    if value is None:
        return 20 if most > 100 else most
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise bad(f"`limit` must be an integer from 1 to {most}", "limit")
    return int(value)


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """name -> (filename, bytes) of a multipart/form-data body, with the standard library's MIME parser
    (no dependency for the one upload endpoint)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad("upload the file as multipart/form-data (fields `file` and `purpose`)", "file")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise bad("the multipart body could not be read", "file")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields
