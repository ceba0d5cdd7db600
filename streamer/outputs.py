"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PromptProgress:
    """A request that has not produced its first token yet: how much of its prompt is computed."""

    computed_tokens: int  # prompt tokens with K/V in the cache (prefix-cache hits included)
    prompt_tokens: int
    scheduled: bool  # False: waiting in the engine's queue for room


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = field(default=None, repr=False)
    error: str | None = None  # why the engine could not run this request (finish_reason "error")
