"""uvicorn's HTTP protocol with a deadline on reading a request's headers.

uvicorn times out an idle keep-alive connection, but not one that is slow to send its headers: a
client trickling a header byte now and then (slow loris), or connecting and sending nothing, held
its connection for as long as it liked (500 such connections were held 60 s). Here every request's
headers must be complete within `timeout_s` of the connection opening or of the previous response
ending; the connection is closed otherwise. A request being served, and a socket upgraded to a
WebSocket, are never cut by it.
"""

from __future__ import annotations

import asyncio
from typing import Any


def with_header_deadline(base: type, timeout_s: float) -> type:
    """A subclass of uvicorn's HTTP protocol class `base` (httptools or h11: both keep the request
    being served in `cycle`) that closes connections whose headers do not arrive in time."""

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # closed already, or a WebSocket now (its own protocol owns the transport)
            if self.cycle is None or self.cycle.response_complete:  # no request whose headers arrived
                self.transport.close()

    return HeaderDeadline
