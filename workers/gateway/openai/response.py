"""Worker events -> OpenAI response objects: streamed chunks and whole responses (docs/openai.md).

One `Assembler` per OpenAI request. It sees every event of the request's jobs in `seq` order (a
resumed stream replays them all from seq 0, so its state is exactly that of the first run) and returns
the chunks each event makes; the SSE writer decides which of them the client still needs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from clients.chat_messages import merge_tool_call_deltas


@dataclass
class StreamMeta:
    """What formatting a request's stream needs; kept in Redis so any gateway can resume it."""

    request_id: str
    kind: str  # "chat" or "completion"
    model: str
    created: int
    n: int
    jobs: list[str]
    include_usage: bool = False
    top_logprobs: int | None = None
    encoding_format: str | None = None  # embeddings (kind "embedding"): "float" or "base64"

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str | bytes) -> StreamMeta:
        return cls(**json.loads(text))

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far (completions' text_offset)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # whole, OpenAI's message shape


def _token_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def worker_error(event: dict[str, Any]) -> dict[str, Any]:
    code = str(event.get("code", "internal"))
    server_side = code in ("internal", "crashed_worker", "too_many_deliveries", "damaged_events")
    return {"message": str(event.get("message", "")), "type": "server_error" if server_side else
            "invalid_request_error", "param": None, "code": code}


class Assembler:
    def __init__(self, meta: StreamMeta) -> None:
        self.meta = meta
        self.choices = [_Choice() for _ in range(len(meta.jobs) * meta.n)]
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.done_jobs = 0
        self.error: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or self.done_jobs == len(self.meta.jobs)

    # --- chunks ------------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.meta.kind == "chat" else "text_completion"
        chunk = {"id": self.meta.object_id, "object": kind, "created": self.meta.created,
                 "model": self.meta.model, "choices": choices}
        if self.meta.include_usage:
            chunk["usage"] = None
        return chunk

    def start_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with each choice's role, as OpenAI's do."""
        if self.meta.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.choices))]

    def on_event(self, job: int, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "token":
            return [self._on_token(job * self.meta.n + int(event.get("index", 0)), event)]
        if kind == "done":
            return self._on_done(job, event)
        self.error = worker_error(event)
        return [{"error": self.error}]

    def _on_token(self, i: int, event: dict[str, Any]) -> dict[str, Any]:
        choice, text = self.choices[i], str(event.get("text", ""))
        logprobs = self._logprobs(choice, event)
        choice.text.append(text)
        choice.length += len(text)
        calls = event.get("tool_calls")
        if calls:  # the worker's deltas are OpenAI's delta.tool_calls already
            merge_tool_call_deltas(choice.tool_calls, calls)
        if self.meta.kind == "chat":
            delta = {"content": text} if not calls else {"content": text or None, "tool_calls": calls}
            return self._chunk([{"index": i, "delta": delta,
                                 "logprobs": None if logprobs is None else {"content": logprobs},
                                 "finish_reason": None}])
        return self._chunk([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def _on_done(self, job: int, event: dict[str, Any]) -> list[dict[str, Any]]:
        reasons = event.get("finish_reasons") or [event.get("finish_reason")]
        chunks = []
        for j in range(self.meta.n):
            i = job * self.meta.n + j
            self.choices[i].finish_reason = reasons[j] if j < len(reasons) else "abort"
            finish = {"index": i, "logprobs": None, "finish_reason": self.choices[i].finish_reason}
            body = {"delta": {}} if self.meta.kind == "chat" else {"text": ""}
            chunks.append(self._chunk([{**finish, **body}]))
        usage = event.get("usage") or {}
        for key in self.usage:
            self.usage[key] += int(usage.get(key, 0))
        self.done_jobs += 1
        if self.finished and self.meta.include_usage:
            chunks.append({**self._chunk([]), "usage": self.openai_usage()})
        return chunks

    # --- log-probs ---------------------------------------------------------------------------------

    def _logprobs(self, choice: _Choice, event: dict[str, Any]) -> Any:
        """This event's log-probs in the request's format (None when none were asked for)."""
        top_k = self.meta.top_logprobs
        pairs_per_token = event.get("logprobs")
        if top_k is None or pairs_per_token is None:
            return None
        texts_per_token = event.get("logprob_texts") or [[f"token_id:{t}" for t, _ in p] for p in pairs_per_token]
        tokens = []
        for token_id, pairs, texts in zip(event.get("token_ids", []), pairs_per_token, texts_per_token):
            named = [(texts[k], float(lp)) for k, (_, lp) in enumerate(pairs)]
            chosen = next((named[k] for k, (t, _) in enumerate(pairs) if t == token_id), named[-1])
            tokens.append((chosen, named[:top_k]))
        if self.meta.kind == "chat":
            entries = [{**_token_entry(*chosen), "top_logprobs": [_token_entry(*alt) for alt in top]}
                       for chosen, top in tokens]
            choice.logprobs.extend(entries)
            return entries
        return self._completion_logprobs(choice, tokens)

    def _completion_logprobs(self, choice: _Choice, tokens: list[Any]) -> dict[str, Any]:
        offsets, at = [], choice.length
        for (text, _), _top in tokens:
            offsets.append(at)
            at += len(text)
        # OpenAI's completions list the sampled token among the alternatives even outside the top k.
        part = {"tokens": [c[0] for c, _ in tokens], "token_logprobs": [c[1] for c, _ in tokens],
                "top_logprobs": [dict([*top, chosen]) for chosen, top in tokens], "text_offset": offsets}
        choice.logprobs.append(part)
        return part

    # --- the whole response ------------------------------------------------------------------------

    def openai_usage(self) -> dict[str, Any]:
        u = self.usage
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def body(self) -> dict[str, Any]:
        """The non-streaming response, once every job is done."""
        choices = [self._whole_choice(i, c) for i, c in enumerate(self.choices)]
        kind = "chat.completion" if self.meta.kind == "chat" else "text_completion"
        return {"id": self.meta.object_id, "object": kind, "created": self.meta.created, "model": self.meta.model,
                "choices": choices, "usage": self.openai_usage()}

    def _whole_choice(self, i: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        if self.meta.kind == "chat":
            logprobs = None if self.meta.top_logprobs is None else {"content": c.logprobs}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if c.tool_calls:  # OpenAI's content is null when the answer is only calls
                message = {"role": "assistant", "content": text or None, "tool_calls": c.tool_calls}
            return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}
        logprobs = None
        if self.meta.top_logprobs is not None:
            logprobs = {key: [x for part in c.logprobs for x in part[key]]
                        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
