"""What the scheduler reports: counters of its work, for `stats()` and benchmarks, and the prompts
still being computed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from streamer.outputs import PromptProgress
from streamer.request import SeqStatus, Sequence
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
    # Speculative decoding (vLLM's spec_decode counters): sequences that verified drafts, drafts
    # verified, drafts kept, and drafts kept by their position in the guess.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Count a step that is about to run (before its sequences' computed tokens advance)."""
        self.num_steps += 1
        self.max_step_tokens = max(self.max_step_tokens, sum(s.num_new_tokens for s in scheduled))
        prefill = [s for s in scheduled if s.seq.num_computed_tokens < s.seq.num_prompt_tokens]
        if prefill and len(prefill) < len(scheduled):
            self.num_mixed_steps += 1
        self.num_partial_prefills += sum(1 for s in prefill if not s.samples_next_token)
        self.prompt_tokens_computed += sum(s.num_new_prompt_tokens for s in prefill)

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_drafts
        self.spec_decode_num_accepted_tokens += num_accepted
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def as_dict(self) -> dict[str, int | list[int]]:
        return asdict(self)


def prompt_progress(seqs: Iterable[Sequence]) -> dict[str, PromptProgress]:
    """Requests still computing their prompt (or waiting to), by id: for "processing the prompt"
    displays while a long prompt runs in chunks over many steps."""
    progress = {}
    for seq in seqs:
        if seq.num_computed_tokens < seq.num_prompt_tokens and seq.request_id not in progress:
            progress[seq.request_id] = PromptProgress(seq.num_computed_tokens, seq.num_prompt_tokens,
                                                      seq.status is SeqStatus.RUNNING)
    return progress
