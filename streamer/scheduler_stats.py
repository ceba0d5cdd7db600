"""Counters of the scheduler's work, for `stats()` and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from streamer.scheduler_output import ScheduledSeq


@dataclass
class SchedulerStats:
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    max_step_tokens: int = 0
    num_mixed_steps: int = 0  # steps mixing prefill and decode work
    num_partial_prefills: int = 0  # prompt chunks cut short by the token budget
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of those, made for a more urgent waiting sequence
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0

    def record_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Count a step that is about to run (before its sequences' computed tokens advance)."""
        self.num_steps += 1
        self.max_step_tokens = max(self.max_step_tokens, sum(s.num_new_tokens for s in scheduled))
        prefill = [s for s in scheduled if s.seq.num_computed_tokens < s.seq.num_prompt_tokens]
        if prefill and len(prefill) < len(scheduled):
            self.num_mixed_steps += 1
        self.num_partial_prefills += sum(1 for s in prefill if not s.samples)
        self.prompt_tokens_computed += sum(s.num_new_prompt_tokens for s in prefill)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
