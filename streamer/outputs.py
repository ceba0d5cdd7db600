"""What the engine hands back to callers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PromptProgress:
    """A request that has not produced its first token yet: how much of its prompt is computed."""

    computed_tokens: int  # prompt tokens with K/V in the cache (prefix-cache hits included)
    prompt_tokens: int
    scheduled: bool  # False: waiting in the engine's queue for room


@dataclass
class RequestMetrics:
    """When a request reached each stage (time.monotonic(), seconds), for latency metrics."""

    arrival_time: float = field(default_factory=time.monotonic)  # added to the engine
    first_scheduled_time: float | None = None  # its first step ran (the end of its queue time)
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True)
class StepPhases:
    """Where a step's execution went (seconds), as the in-process model runner measures it."""

    prepare_s: float  # flattening the batch, copying it to the device, building the inputs
    forward_s: float
    sample_s: float


@dataclass(frozen=True)
class StepRecord:
    """One engine step: what ran and where its time went (seconds), for metrics and slow-step traces."""

    index: int
    started: float  # time.monotonic()
    num_seqs: int
    num_tokens: int  # tokens computed: prompt chunks and decodes
    num_prefill_tokens: int
    schedule_s: float
    execute_s: float  # preparing the inputs, the forward pass and sampling
    process_s: float  # updating the sequences, detokenizing, stop checks
    phases: StepPhases | None = None  # execute_s split up (None: a tensor-parallel executor)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.process_s


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
    error_code: str | None = None  # "invalid_params": the request's own spec was at fault; None: the engine's
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # An embedding request's pooled vector (streamer/pooling.py), on its one finished output; None otherwise
    embedding: list[float] | None = field(default=None, repr=False)
