"""Errors of the wire contract (docs/protocol.md), shared by the client and the server side.

`ProtocolError` is raised for bytes or maps that break the contract (the worker and the gateway
answer it with an `error` event or frame); `RequestFailed` is what the client raises when the
worker answered a request with an `error` event; `UnknownRequest` when a request id names nothing
in Redis (never submitted, or its keys expired); `NoWorker` when nothing arrives and no worker is
alive to serve the request.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A job that cannot be served. `code` is the machine-readable error code of the `error` event;
    `request_id` is set when the id could be read (the caller then gets an event, not only a dead letter)."""

    def __init__(self, code: str, message: str, request_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.param = param  # the field at fault, where one is (the OpenAI API's error `param`)


class RequestFailed(RuntimeError):
    """The worker answered the request with an `error` event."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {code}: {message}")
        self.request_id, self.code, self.message = request_id, code, message


class UnknownRequest(LookupError):
    """No request with this id in Redis (never submitted, or expired): e.g. a cancel for a made-up id,
    which must not leave a key behind. `code` is `unknown_request`, as in the gateway's error frame."""

    code = "unknown_request"

    def __init__(self, request_id: str, message: str = "") -> None:
        super().__init__(message or f"no request {request_id!r} (never submitted, or expired)")
        self.request_id = request_id


class NoWorker(RuntimeError):
    """Nothing arrived for a request and no worker is alive to serve it (none in the heartbeat set):
    without this a client would wait silently for an answer that cannot come. `code` is `no_worker`."""

    code = "no_worker"

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id, self.message = request_id, message


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ':'}***@{host}"
