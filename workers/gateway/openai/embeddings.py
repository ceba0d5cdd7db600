"""`/v1/embeddings` with OpenAI's request and response shapes (docs/openai.md#embeddings).

Each input is one job on the queue (`task` embed, clients/protocol.py), so embeddings share the stream,
the lanes, the tenants' limits and the engine's batches with generation; a worker answers each with one
`done` event holding the vector (workers/worker/tasks.py). The request parses into an `OpenAIRequest`
like the completions endpoints' (one prompt per job), which is how the live endpoint and the Batch API
build the same jobs (job_builder.py); `EmbeddingAssembler` turns the events into OpenAI's answer.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from clients.job_tasks import POOLINGS
from clients.numbers import is_int
from workers.gateway.openai.request import OpenAIRequest, bad, check_fields
from workers.gateway.openai.response import Assembler, StreamMeta, worker_error

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
ENCODINGS = ("float", "base64")
# OpenAI's fields, and two of the engine's options: `normalize` (vLLM's) and `pooling` (streamer's).
FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "normalize", "pooling"}
_SHAPES = "a string, an array of strings, an array of token ids or an array of arrays of token ids"


def parse_embeddings(body: Any) -> OpenAIRequest:
    """An embeddings body -> one prompt per input, each an embed job's fields; 400 for anything else."""
    body = check_fields(body, FIELDS)
    options: dict[str, Any] = {}
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not is_int(dimensions) or dimensions < 1:
            raise bad("`dimensions` must be a positive integer", "dimensions")
        options["dimensions"] = dimensions  # the worker refuses it unless its model is a matryoshka model
    if body.get("normalize") is not None:
        if not isinstance(body["normalize"], bool):
            raise bad("`normalize` must be a boolean", "normalize")
        options["normalize"] = body["normalize"]
    if body.get("pooling") is not None:
        if body["pooling"] not in POOLINGS:
            raise bad(f"`pooling` must be one of {list(POOLINGS)}", "pooling")
        options["pooling"] = body["pooling"]
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise bad(f"`encoding_format` must be one of {list(ENCODINGS)}", "encoding_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("`user` must be a string", "user")
    prompts = [{**prompt, "task": "embed", "options": options} for prompt in _inputs(body.get("input"))]
    return OpenAIRequest("embedding", body["model"], False, False, 1, None, prompts, user=user,
                         encoding_format=encoding or "float")


def _inputs(value: Any) -> list[dict[str, Any]]:
    """Each input as a job's prompt: {"prompt": text} or {"prompt_token_ids": ids}."""
    if value is None:
        raise bad("you must provide an `input`", "input", "missing_required_parameter")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        value = [value]  # one prompt's token ids
    if not isinstance(value, list) or not value:
        raise bad(f"`input` must be {_SHAPES}, and not empty", "input")
    if len(value) > MAX_INPUTS:
        raise bad(f"`input` holds {len(value)} inputs; at most {MAX_INPUTS}", "input")
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item:
            prompts.append({"prompt": item})
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            prompts.append({"prompt_token_ids": item})
        elif item in ("", []):
            raise bad(f"`input[{i}]` is empty: each input needs at least one token", "input")
        else:
            raise bad(f"`input[{i}]` is neither a string nor an array of token ids: `input` must be {_SHAPES}",
                      "input")
    if len({type(p.get("prompt")) for p in prompts}) > 1:
        raise bad(f"`input` mixes strings and token ids: it must be {_SHAPES}", "input")
    return prompts


def _is_token(value: Any) -> bool:
    return is_int(value) and value >= 0


class EmbeddingAssembler:
    """The embedding jobs' `done` events -> OpenAI's embeddings list (the Assembler's surface)."""

    def __init__(self, meta: StreamMeta) -> None:
        self.meta = meta
        self.vectors: dict[int, list[float]] = {}
        self.prompt_tokens = 0
        self.error: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.vectors) == len(self.meta.jobs)

    def on_event(self, job: int, event: dict[str, Any]) -> list[dict[str, Any]]:
        if event.get("type") == "error":
            self.error = worker_error(event)
        elif event.get("type") == "done":
            result = event.get("result")
            if not isinstance(result, dict) or "embedding" not in result:  # cancelled before it ran
                self.error = {"message": "the request was cancelled before its embedding was computed",
                              "type": "invalid_request_error", "param": None, "code": "cancelled"}
                return []
            self.vectors[job] = result["embedding"]
            self.prompt_tokens += int(result.get("prompt_tokens", 0))
        return []

    def body(self) -> dict[str, Any]:
        base64_format = self.meta.encoding_format == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(self.vectors[i]) if base64_format else self.vectors[i]}
                for i in range(len(self.meta.jobs))]
        return {"id": f"embd-{self.meta.request_id}", "object": "list", "created": self.meta.created,
                "model": self.meta.model, "data": data,
                "usage": {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}}


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def assembler_for(meta: StreamMeta) -> Assembler | EmbeddingAssembler:
    """What builds the answer of a request of this kind (live, or a batch line)."""
    return EmbeddingAssembler(meta) if meta.kind == "embedding" else Assembler(meta)
