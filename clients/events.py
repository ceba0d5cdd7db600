"""The events a worker writes for each request (docs/protocol.md): token, done, error."""

from __future__ import annotations

from typing import Any

from clients.protocol import VERSION


def token_event(request_id: str, seq: int, index: int, token_ids: list[int], text: str,
                logprobs: list[dict[int, float]] | None = None,
                logprob_texts: list[list[str]] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    event = {"v": VERSION, "id": request_id, "seq": seq, "type": "token", "index": index,
             "token_ids": token_ids, "text": text}
    if tool_calls:  # OpenAI-style deltas of the sample's tool calls (docs/protocol.md)
        event["tool_calls"] = tool_calls
    if logprobs is not None:
        # Per token, [token id, log-prob] pairs: JSON object keys could not stay integers.
        event["logprobs"] = [[[int(t), float(lp)] for t, lp in step.items()] for step in logprobs]
    if logprob_texts is not None:
        # The text of each pair's token, decoded alone (what OpenAI-style APIs show as `token`).
        event["logprob_texts"] = logprob_texts
    return event


def done_event(request_id: str, seq: int, finish_reasons: list[str], usage: dict[str, int]) -> dict[str, Any]:
    return {"v": VERSION, "id": request_id, "seq": seq, "type": "done", "index": 0, "token_ids": [],
            "text": "", "finish_reason": finish_reasons[0], "finish_reasons": finish_reasons,
            "usage": usage}


def result_event(request_id: str, seq: int, result: dict[str, Any], prompt_tokens: int = 0) -> dict[str, Any]:
    """The answer of a tokenize, detokenize or embed job: a `done` event (every reader knows it ends the
    request) holding the task's `result`; `prompt_tokens`: what the engine computed for it (an embedding)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
    return {**done_event(request_id, seq, ["stop"], usage), "result": result}


def error_event(request_id: str, seq: int, code: str, message: str) -> dict[str, Any]:
    return {"v": VERSION, "id": request_id, "seq": seq, "type": "error", "index": 0, "token_ids": [],
            "text": "", "code": code, "message": message}
