"""The pieces of a client's WebSocket frames the session reads and writes: sizes, ids, error frames."""

from __future__ import annotations

import json
from typing import Any

from clients.errors import ProtocolError
from clients.protocol import ID_RE


def size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


# `after_seq` beyond this cannot be a seq (Redis stream ids are 64-bit; seq n is stored as 0-(n+1)).
MAX_SEQ = 2**63 - 2


def error_frame(request_id: str | None, code: str, message: str, extra: dict[str, Any] | None = None) -> str:
    # ASCII only: a message that quotes a client's bad text (a lone surrogate) must still be sendable.
    return json.dumps({"type": "error", "id": request_id, "code": code, "message": message,
                       "source": "gateway", **(extra or {})})


def frame_id(obj: dict[str, Any]) -> str | None:
    """The frame's request id when it is a valid one (only such ids are echoed back in errors)."""
    rid = obj.get("id")
    return rid if isinstance(rid, str) and ID_RE.match(rid) else None


def wants_progress(obj: dict[str, Any]) -> bool:
    """`"progress": true` in a generate or resume frame asks for `status` and `resumed` frames."""
    return obj.get("progress") is True


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def request_id(obj: dict[str, Any]) -> str:
    """The frame's request id, or ProtocolError `invalid_request`."""
    rid = obj.get("id")
    if not isinstance(rid, str) or not ID_RE.match(rid):
        raise ProtocolError("invalid_request", "`id` must be a string of 1-128 characters from "
                            "A-Z a-z 0-9 . _ : @ / + = -")
    return rid
