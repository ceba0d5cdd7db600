"""Requests and their sequences: the plain state the scheduler and the engine move forward."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from streamer.detokenizer import IncrementalDetokenizer
from streamer.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request: the unit the scheduler schedules and the block manager pages.

    `token_ids` is prompt + generated tokens; the first `num_computed_tokens` of them have K/V in
    the cache. The engine's single rule: each step brings `num_computed_tokens` closer to
    `len(token_ids)`; when they meet, the model samples the next token.
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full computed blocks
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    # Siblings of a parallel-sampling request, forked from this one once its prompt is computed.
    pending_forks: list[Sequence] = field(default_factory=list)
    # Generated since the last output was handed to the caller (deltas).
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, float]] = field(default_factory=list)
    beam_logprobs: Any = None  # beam search: next-token log-probs, waiting for the sibling beams

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    """A caller's request: a prompt and `n` sequences sampled from it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    prompt: str | None = None
    beam: Any = None  # beam_search.BeamState for beam-search requests

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)
