"""Plain HTTP on the gateway's port, and the checks a WebSocket handshake must pass.

websockets parses every request on the port and calls `process_request` first: returning a Response
answers it as plain HTTP (the chat page, /livez, /readyz, /healthz, /metrics), returning None lets the
upgrade to `/ws` go on. Refusals (bad API key, foreign origin) happen here, before any frame or job.
"""

from __future__ import annotations

import hmac
import http
import json
import mimetypes
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

WS_PATH = "/ws"
_STATIC_SUFFIXES = {".html", ".js", ".mjs", ".css", ".svg", ".png", ".ico", ".json", ".txt", ".woff2"}
_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".html": "text/html", ".css": "text/css"}
# The page loads only its own files and talks only to its own gateway (no CDN, works offline).
_PAGE_POLICY = ("default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
                "style-src 'self'; script-src 'self'; frame-ancestors 'none'; base-uri 'none'")


def response(status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
             extra: list[tuple[str, str]] | None = None) -> Response:
    data = body.encode() if isinstance(body, str) else body
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(data))),
                       ("Cache-Control", "no-cache"), ("X-Content-Type-Options", "nosniff"),
                       *(extra or [])])
    return Response(status, http.HTTPStatus(status).phrase, headers, data)


def static_files(root: Path) -> dict[str, Path]:
    """URL path -> file, listed once at startup: nothing outside this map is ever served."""
    files = {"/" + p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
             if p.is_file() and p.suffix in _STATIC_SUFFIXES and not p.name.startswith(".")}
    if "/index.html" in files:
        files["/"] = files["/index.html"]
    return files


def request_token(request: Request) -> str | None:
    """An API key from `Authorization: Bearer KEY`, or `?token=KEY` (browsers cannot set headers on a
    WebSocket)."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


def key_ok(request: Request, api_keys: tuple[str, ...]) -> bool:
    if not api_keys:
        return True
    token = request_token(request)
    if not token:
        return False
    # Compare with every key in constant time, so timing does not reveal a key's prefix.
    return any([hmac.compare_digest(token.encode(), k.encode()) for k in api_keys])


def origin_ok(request: Request, allowed: tuple[str, ...]) -> bool:
    """Browsers always send Origin; other clients usually don't and are not subject to it. With no
    list, only the gateway's own pages may connect (a foreign site cannot use a visitor's browser)."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed:
        return True
    if allowed:
        return origin.rstrip("/") in allowed
    return urlsplit(origin).netloc.lower() == request.headers.get("Host", "").lower()


class Routes:
    def __init__(self, web_root: Path, api_keys: tuple[str, ...], allowed_origins: tuple[str, ...],
                 health: Callable[[], Awaitable[tuple[bool, dict]]], metrics: Callable[[], str],
                 on_refused: Callable[[], None], room: Callable[[], bool] = lambda: True,
                 live: Callable[[], dict[str, Any]] = lambda: {"ok": True}) -> None:
        self.files = static_files(web_root)
        self.live = live
        self.room = room
        self.api_keys = api_keys
        self.allowed_origins = tuple(o.rstrip("/") for o in allowed_origins)
        self.health, self.metrics, self.on_refused = health, metrics, on_refused

    async def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == WS_PATH:
            if not origin_ok(request, self.allowed_origins):
                self.on_refused()
                return response(403, "origin not allowed: start the gateway with --allowed-origin\n")
            if not key_ok(request, self.api_keys):
                self.on_refused()
                return response(401, "missing or invalid API key: send `Authorization: Bearer KEY` "
                                     "or connect to /ws?token=KEY\n",
                                extra=[("WWW-Authenticate", 'Bearer realm="streamer"')])
            if not self.room():
                self.on_refused()
                return response(503, "too many connections to this gateway; retry later\n",
                                extra=[("Retry-After", "5")])
            return None
        if path == "/livez":
            return response(200, json.dumps(self.live()) + "\n", "application/json")
        if path in ("/readyz", "/healthz"):  # /healthz: the name it always had, same meaning
            ok, body = await self.health()
            return response(200 if ok else 503, json.dumps(body) + "\n", "application/json")
        if path == "/metrics":
            if not key_ok(request, self.api_keys):
                return response(401, "missing or invalid API key\n")
            return response(200, self.metrics(), "text/plain; version=0.0.4; charset=utf-8")
        file = self.files.get(path)
        if file is None:
            return response(404, f"not found: {path}\n")
        try:
            data = file.read_bytes()
        except OSError:
            return response(404, f"not found: {path}\n")
        kind = _TYPES.get(file.suffix) or mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if kind.startswith("text/"):
            kind += "; charset=utf-8"
        extra = [("Content-Security-Policy", _PAGE_POLICY)] if file.suffix == ".html" else []
        return response(200, data, kind, extra)
