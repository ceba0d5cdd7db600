"""What one scheduler step hands the model runner, and what the update step hands back: plain
data flowing one way (scheduler -> runner -> scheduler.update_from_output -> output processor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamer.request import Request, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    block_ids: list[int] = field(default_factory=list)  # the sequence's block table, from the block manager
    forks: list[Sequence] = field(default_factory=list)  # siblings that sample from this row
    # Guessed next tokens (speculative decoding), computed after the sequence's own: counted in
    # `num_new_tokens`, each row verified, kept only as far as the verification accepts them.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_new_prompt_tokens(self) -> int:
        """Of the tokens this chunk computes, how many are prompt (read before the step advances it)."""
        start = self.seq.num_computed_tokens
        return max(0, min(start + self.num_new_tokens, self.seq.num_prompt_tokens) - start)

    @property
    def samples_next_token(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_new_prompt_tokens for s in self.scheduled)


@dataclass
class SeqUpdate:
    """One sampled token of one sequence, and whether a token rule (EOS, stop token ids,
    lengths) finished the sequence with it. Stop strings are the output processor's."""

    seq: Sequence
    token_id: int
    logprobs: dict[int, float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamResult:
    """A finished beam search: its best hypotheses, best first."""

    request: Request
    token_ids: list[list[int]]
    finished_by_eos: list[bool]


@dataclass
class PooledResult:
    """A pooling sequence whose prompt is computed: its embedding (streamer/pooling.py)."""

    seq: Sequence
    embedding: list[float]


@dataclass
class StepUpdates:
    """What one step changed, for the output processor: each sampled token, each finished beam search,
    each finished embedding."""

    updates: list[SeqUpdate] = field(default_factory=list)
    beam_results: list[BeamResult] = field(default_factory=list)
    pooled: list[PooledResult] = field(default_factory=list)
