"""The gateway's HTTP side on Starlette: the chat page, health, metrics, and the checks `/ws` must pass.

Refusals (bad API key, foreign origin, no room) happen before the WebSocket is accepted, as plain
HTTP answers (the ASGI denial-response extension), so a refused client never gets a frame or a job.
The OpenAI-compatible API is mounted beside these (openai/routes.py).
"""

from __future__ import annotations

import hmac
import json
import mimetypes
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

WS_PATH = "/ws"
_STATIC_SUFFIXES = {".html", ".js", ".mjs", ".css", ".svg", ".png", ".ico", ".json", ".txt", ".woff2"}
_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".html": "text/html", ".css": "text/css"}
# The page loads only its own files and talks only to its own gateway (no CDN, works offline).
_PAGE_POLICY = ("default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
                "style-src 'self'; script-src 'self'; frame-ancestors 'none'; base-uri 'none'")


def response(status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
             extra: dict[str, str] | None = None) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(extra or {})}
    return Response(body, status_code=status, media_type=content_type, headers=headers)


def static_files(root: Path) -> dict[str, Path]:
    """URL path -> file, listed once at startup: nothing outside this map is ever served."""
    files = {"/" + p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
             if p.is_file() and p.suffix in _STATIC_SUFFIXES and not p.name.startswith(".")}
    if "/index.html" in files:
        files["/"] = files["/index.html"]
    return files


def request_token(conn: HTTPConnection) -> str | None:
    """An API key from `Authorization: Bearer KEY`, or `?token=KEY` (browsers cannot set headers on a
    WebSocket)."""
    auth = conn.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return conn.query_params.get("token")


def key_ok(conn: HTTPConnection, api_keys: tuple[str, ...]) -> bool:
    if not api_keys:
        return True
    token = request_token(conn)
    if not token:
        return False
    # Compare with every key in constant time, so timing does not reveal a key's prefix.
    return any([hmac.compare_digest(token.encode(), k.encode()) for k in api_keys])


def origin_ok(conn: HTTPConnection, allowed: tuple[str, ...]) -> bool:
    """Browsers always send Origin; other clients usually don't and are not subject to it. With no
    list, only the gateway's own pages may connect (a foreign site cannot use a visitor's browser)."""
    origin = conn.headers.get("origin")
    if origin is None or "*" in allowed:
        return True
    if allowed:
        return origin.rstrip("/") in allowed
    return urlsplit(origin).netloc.lower() == conn.headers.get("host", "").lower()


class Routes:
    def __init__(self, web_root: Path, api_keys: tuple[str, ...], allowed_origins: tuple[str, ...],
                 health: Callable[[], Awaitable[tuple[bool, dict]]],
                 metrics: Callable[[str | None], tuple[bytes, str]],
                 on_refused: Callable[[], None], room: Callable[[], bool] = lambda: True,
                 live: Callable[[], dict[str, Any]] = lambda: {"ok": True}) -> None:
        self.files = static_files(web_root)
        self.live = live
        self.room = room
        self.api_keys = api_keys
        self.allowed_origins = tuple(o.rstrip("/") for o in allowed_origins)
        self.health, self.metrics, self.on_refused = health, metrics, on_refused

    def routes(self, serve_socket: Callable[[WebSocket], Awaitable[None]]) -> list[Any]:
        async def ws_endpoint(ws: WebSocket) -> None:
            refusal = self.refuse_socket(ws)
            if refusal is not None:
                self.on_refused()
                return await ws.send_denial_response(refusal)
            await ws.accept()
            await serve_socket(ws)

        return [WebSocketRoute(WS_PATH, ws_endpoint), Route(WS_PATH, self._upgrade_only),
                Route("/livez", self._livez), Route("/readyz", self._ready), Route("/healthz", self._ready),
                Route("/metrics", self._metrics)]

    def refuse_socket(self, ws: WebSocket) -> Response | None:
        if not origin_ok(ws, self.allowed_origins):
            return response(403, "origin not allowed: start the gateway with --allowed-origin\n")
        if not key_ok(ws, self.api_keys):
            return response(401, "missing or invalid API key: send `Authorization: Bearer KEY` "
                                 "or connect to /ws?token=KEY\n",
                            extra={"WWW-Authenticate": 'Bearer realm="streamer"'})
        if not self.room():
            return response(503, "too many connections to this gateway; retry later\n", extra={"Retry-After": "5"})
        return None

    async def _upgrade_only(self, request: Request) -> Response:
        return response(426, f"{WS_PATH} is a WebSocket endpoint: connect with a WebSocket client\n",
                        extra={"Upgrade": "websocket", "Connection": "Upgrade"})

    async def _livez(self, request: Request) -> Response:
        return response(200, json.dumps(self.live()) + "\n", "application/json")

    async def _ready(self, request: Request) -> Response:  # /healthz: the name it always had, same meaning
        ok, body = await self.health()
        return response(200 if ok else 503, json.dumps(body) + "\n", "application/json")

    async def _metrics(self, request: Request) -> Response:
        if not key_ok(request, self.api_keys):
            return response(401, "missing or invalid API key\n")
        body, content_type = self.metrics(request.headers.get("accept"))  # OpenMetrics if asked for
        return response(200, body, content_type)

    async def static(self, request: Request) -> Response:
        """Anything no route took: one of the page's files, or 404."""
        path = request.url.path
        file = self.files.get(path) if request.method in ("GET", "HEAD") else None
        if file is None:
            return response(404, f"not found: {path}\n")
        try:
            data = file.read_bytes()
        except OSError:
            return response(404, f"not found: {path}\n")
        kind = _TYPES.get(file.suffix) or mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if kind.startswith("text/"):
            kind += "; charset=utf-8"
        extra = {"Content-Security-Policy": _PAGE_POLICY} if file.suffix == ".html" else {}
        return response(200, data, kind, extra)
