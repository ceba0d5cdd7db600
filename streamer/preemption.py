"""The scheduler's priority rules: which running sequences more urgent waiting ones preempt, and which
prompts leave a step to more urgent ones.

Pure: reads the waiting heads, the running sequences, the block manager and the step so far, changes
nothing; the scheduler preempts what `priority_victims` returns, before the step hands out seats,
blocks and tokens.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

from streamer.block_manager import BlockManager, PrefixHit
from streamer.request import Sequence
from streamer.scheduler_output import SchedulerOutput


class Room(enum.Enum):
    FITS = 1  # admitted this step as things are
    SHORT = 2  # short of a seat or of blocks: preempting less urgent work can help
    WAITS = 3  # waits for the token budget or for a prefix being computed: preempting would not help


def priority_victims(heads: Iterable[Sequence], running: list[Sequence], block_manager: BlockManager,
                     max_num_seqs: int, max_num_batched_tokens: int) -> list[Sequence]:
    """Running sequences to preempt so that the waiting `heads` (the queue's first, in its order) are
    admitted this step: for each head in turn, the fewest of the running sequences less urgent than
    it (the least urgent, the latest admitted first among equals) that make room for it after the
    share of the running sequences scheduled before the heads and of the heads before it. The walk
    stops at the first head that nobody less urgent runs for, that even every candidate would not
    make room for (they would be recomputed for nothing), or that waits for the budget: the heads
    after it wait too."""
    victims: list[Sequence] = []
    ahead: list[tuple[Sequence, PrefixHit]] = []
    first: list[Sequence] | None = None  # the running sequences scheduled before the heads
    for head in heads:
        gone = {v.seq_id for v in victims}
        candidates = [s for s in _candidates(head.priority, running) if s.seq_id not in gone]
        if not candidates:  # the common case (one priority): no need to weigh room
            break
        if first is None:  # the scheduler defers prompts relative to the queue's head: the walk's first
            first = [s for s in running if not yields_budget(s, head.priority)]
        hit = block_manager.find_cached_prefix(head)
        chosen: list[Sequence] = []
        while (room := _room_for(head, hit, victims + chosen, ahead, running, first, block_manager, max_num_seqs,
                                 max_num_batched_tokens)) is Room.SHORT and len(chosen) < len(candidates):
            chosen.append(candidates[len(chosen)])
        if room is not Room.FITS:
            break
        victims += chosen
        ahead.append((head, hit))
    return victims


def _candidates(priority: int, running: list[Sequence]) -> list[Sequence]:
    """Running sequences strictly less urgent than `priority`, in the order to preempt them.
    Beams are left alone: a beam step needs every beam of its request, and parking one for
    a stranger would stall its siblings."""
    ranked = [(s.priority, i, s) for i, s in enumerate(running)
              if s.priority > priority and not s.params.use_beam_search]
    return [s for _, _, s in sorted(ranked, key=lambda r: (r[0], r[1]), reverse=True)]


def yields_budget(seq: Sequence, urgent: int) -> bool:
    """Whether a running sequence takes its share of a step's tokens only after the waiting sequences
    of priority `urgent` are admitted: it computes a prompt (or recomputes after a preemption) in
    chunks and is less urgent. A decode always goes first: one token, and it holds its seat anyway."""
    return seq.priority > urgent and seq.num_tokens - seq.num_computed_tokens > 1


def prompt_priority(out: SchedulerOutput) -> float:
    """The most urgent priority of the prompts (chunks, recomputes) a step computes so far (inf: none)."""
    return min((item.seq.priority for item in out.scheduled if item.num_new_prompt_tokens or item.num_new_tokens > 1),
               default=math.inf)


def waits_for_step(priority: int, step_priority: float, background: int | None) -> bool:
    """Whether a prompt of `priority` waits for a later step: it is background work (`background` or
    less urgent: a Batch API line) and the step already computes a prompt that is not (of priority
    `step_priority`). A batch line's prompt never makes the step of an interactive prompt longer; it
    runs in the steps that compute no other prompt."""
    return background is not None and priority >= background > step_priority


def _room_for(head: Sequence, hit: PrefixHit, victims: list[Sequence], ahead: list[tuple[Sequence, PrefixHit]],
              running: list[Sequence], first: list[Sequence], bm: BlockManager, max_num_seqs: int,
              max_num_batched_tokens: int) -> Room:
    """Whether, without `victims`, seats and blocks let `head` be admitted this step after the share of
    the running sequences scheduled `first` and the heads `ahead` of it (not the token budget, which
    frees itself as prompts finish). Blocks shared with others count as staying: an estimate that errs
    towards fewer victims."""
    gone = {v.seq_id for v in victims}
    if len(running) - len(victims) + len(ahead) >= max_num_seqs:
        return Room.SHORT
    budget, needed = max_num_batched_tokens, 0
    for seq, seq_hit in [(s, None) for s in first if s.seq_id not in gone] + ahead:  # in the step's order
        if budget > 0:
            start = seq.num_computed_tokens if seq_hit is None else seq_hit.num_tokens
            num_new = min(seq.num_tokens - start, budget)
            needed += bm.blocks_needed(seq, num_new, seq_hit) if num_new else 0
            budget -= num_new
    if budget <= 0 or hit.pending:
        return Room.WAITS
    needed += bm.blocks_needed(head, min(head.num_tokens - hit.num_tokens, budget), hit)
    freed = sum(1 for v in victims for b in bm.block_table(v) if bm.blocks[b].ref_count == 1)
    return Room.FITS if needed <= bm.num_free_blocks + freed else Room.SHORT
