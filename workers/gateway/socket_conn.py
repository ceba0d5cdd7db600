"""One accepted WebSocket as the session sees it: frames in, text out, close, abort.

The socket is Starlette's (ASGI, served by uvicorn). ASGI has no way to drop a connection without a
closing handshake, which is what a reader that never drains its socket needs after the close frame
timed out: `abort` reaches the server's transport, which `with_transport` puts in the socket's scope.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

_ids = itertools.count(1)


class SocketClosed(Exception):
    """The peer went away (or the socket was closed) while sending."""


class SocketConn:
    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.id = next(_ids)  # for log lines

    async def frames(self) -> AsyncIterator[str | bytes]:
        """Text or binary frames until the peer closes."""
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            yield text if text is not None else (message.get("bytes") or b"")

    async def send(self, text: str) -> None:
        if self.ws.application_state is not WebSocketState.CONNECTED:
            raise SocketClosed
        try:
            await self.ws.send_text(text)
        except Exception as e:  # uvicorn's ClientDisconnected, Starlette's state errors, OSError
            raise SocketClosed from e

    async def close(self, code: int, reason: str, timeout_s: float) -> None:
        """Send a close frame; a peer that does not take it within `timeout_s` is cut off."""
        if self.ws.application_state is WebSocketState.CONNECTED:
            try:
                await asyncio.wait_for(self.ws.close(code, reason), timeout=timeout_s)
            except (TimeoutError, Exception):
                self.abort()

    def abort(self) -> None:
        transport = _transport(self.ws)
        if transport is not None and not transport.is_closing():
            transport.abort()


TRANSPORT_KEY = "streamer.transport"


def _transport(ws: WebSocket) -> Any:
    return ws.scope.get(TRANSPORT_KEY)


async def with_transport(app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """ASGI wrapper: a WebSocket's scope gets the server's transport under TRANSPORT_KEY (uvicorn's
    `send` is a method of the protocol object that owns it), so `SocketConn.abort` can reach it."""
    if scope["type"] == "websocket":
        scope[TRANSPORT_KEY] = getattr(getattr(send, "__self__", None), "transport", None)
    await app(scope, receive, send)
