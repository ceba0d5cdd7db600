"""Requests and their sequences: the plain scheduling state the scheduler moves forward.

What is not scheduling state lives with its owner: block tables and block hashes with the block
manager, text and stop strings with the output processor, beam scores with the beam search.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamer.lora.request import LoRARequest
from streamer.outputs import RequestMetrics
from streamer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from streamer.grammar import GrammarState
    from streamer.pooling import PoolingState

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Preempted with nothing left to compute (a beam waiting for its siblings): it rejoins the
    # queue only when the beam step extends it.
    PARKED = "parked"
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
    priority: int = 0
    session: str | None = None  # the conversation or agent it belongs to: its attained service ranks it
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    grammar: GrammarState | None = field(default=None, repr=False)  # structured outputs (grammar.py)
    lora: LoRARequest | None = None  # the adapter it runs under (streamer/lora); None: the base model
    # An embedding: its prompt is computed and pooled (streamer/pooling.py), nothing sampled; None: generation
    pooling: PoolingState | None = field(default=None, repr=False)

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

    def sibling(self) -> Sequence:
        """A new sequence of the same request holding the same tokens (nothing computed)."""
        return Sequence(request_id=self.request_id, index=self.index, token_ids=list(self.token_ids),
                        num_prompt_tokens=self.num_prompt_tokens, params=self.params, priority=self.priority,
                        session=self.session, lora=self.lora)


@dataclass(eq=False)
class Request:
    """A caller's request: a prompt and `n` sequences sampled from it (beams, for beam search)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    prompt: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)
