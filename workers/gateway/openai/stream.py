"""Server-Sent Events framing of an OpenAI stream, with positions a client can resume from.

By default a stream is byte for byte in OpenAI's shape: `data: {...}` messages and `data: [DONE]`,
nothing else, since many readers (vLLM's benchmark client among them) treat every message as
`data:` only. A client that asks for a resumable stream (header `X-Resumable-Stream: true`, or a
resume) gets the same messages with an `id:` line each and an opening comment that starts the
response before the first token.

Each worker event makes one or more chunks (a `done` makes one per sample, plus the usage chunk at the
end). The last chunk of event `seq` has the SSE id `<request id>:<seq>`; the ones before it
`<request id>:<seq>.<k>` (chunk k of that event). A chat stream's opening role chunks belong to event
-1. `Last-Event-ID` (or `?after=`) names the last chunk the client has: everything after it follows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from workers.gateway.openai.jobs import SHUTDOWN
from workers.gateway.openai.request import bad
from workers.gateway.openai.response import Assembler, StreamMeta

_WHOLE = 1 << 30  # "every chunk of this event"
# One encoder for every chunk: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_SHUTTING_DOWN = {"error": {"message": "the gateway is shutting down: the answer goes on; resume it (Last-Event-ID, or "
                                      "GET /v1/streams/ID) through a gateway that is up",
                            "type": "server_error", "param": None, "code": "shutting_down"}}


@dataclass(frozen=True, order=True)
class Position:
    seq: int
    chunk: int

    @classmethod
    def start(cls) -> Position:
        return cls(-2, _WHOLE)

    @classmethod
    def parse(cls, text: str | None) -> Position:
        """"S" (all of event S received) or "S.k" (chunks 0..k of event S); None: from the start."""
        if text is None or text == "":
            return cls.start()
        seq, _, chunk = text.partition(".")
        try:
            position = cls(int(seq), int(chunk) if chunk else _WHOLE)
        except ValueError as e:
            raise bad(f"not a stream position: {text[:40]!r} (expected SEQ or SEQ.K)", "after") from e
        if position.seq < -1 or position.chunk < 0:
            raise bad(f"not a stream position: {text[:40]!r}", "after")
        return position


def wants_resumable(headers: Mapping[str, str]) -> bool:
    """A stream with `id:` lines only for a client that asks: OpenAI's own has none, and readers
    that take every message for `data:` fail on them."""
    return headers.get("x-resumable-stream", "").strip().lower() in ("1", "true", "yes")


def _frame(request_id: str | None, seq: int, k: int, count: int, chunk: dict[str, Any]) -> str:
    if request_id is None:
        return f"data: {_ENCODER.encode(chunk)}\n\n"
    sse_id = f"{request_id}:{seq}" if k == count - 1 else f"{request_id}:{seq}.{k}"
    return f"id: {sse_id}\ndata: {_ENCODER.encode(chunk)}\n\n"


def _framed(request_id: str | None, seq: int, chunks: list[dict[str, Any]], after: Position) -> list[str]:
    count = len(chunks)
    return [_frame(request_id, seq, k, count, c) for k, c in enumerate(chunks)
            if Position(seq, k if k < count - 1 else _WHOLE) > after]


async def sse_events(events: AsyncIterator[tuple[int, dict[str, Any]]], assembler: Assembler, meta: StreamMeta,
                     after: Position, fresh: bool, resumable: bool) -> AsyncIterator[str]:
    """SSE text for the chunks after `after`, then `data: [DONE]`; `id:` lines only if `resumable`. A
    gateway shutting down ends it with an error event and no `[DONE]`: the answer is not over, and a
    client resumes it elsewhere from its last id."""
    if fresh and resumable:
        yield ": streamer\n\n"  # the response starts at once, before the first token (a comment line)
    for text in _framed(meta.request_id if resumable else None, -1, assembler.start_chunks(), after):
        yield text
    async for job, event in events:
        if event is SHUTDOWN:
            yield f"data: {_ENCODER.encode(_SHUTTING_DOWN)}\n\n"
            return
        seq = int(event.get("seq", 0))
        sse_rid = None if not resumable else meta.jobs[job] if len(meta.jobs) > 1 else meta.request_id
        for text in _framed(sse_rid, seq, assembler.on_event(job, event), after):
            yield text
        if assembler.error is not None:
            break
    yield "data: [DONE]\n\n"
