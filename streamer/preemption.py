"""Which running sequences a more urgent waiting one preempts (the scheduler's priority rule).

Pure: reads the running sequences and the block manager, changes nothing; the scheduler preempts
what it returns.
"""

from __future__ import annotations

from streamer.block_manager import BlockManager
from streamer.request import Sequence


def priority_victims(head: Sequence, running: list[Sequence], block_manager: BlockManager, max_num_seqs: int,
                     max_num_batched_tokens: int) -> list[Sequence]:
    """The fewest of the least urgent running sequences (the latest admitted first among equals)
    whose preemption makes room for `head`; none at all when even every candidate would not make
    room: they would be recomputed for nothing."""
    candidates = _candidates(head.priority, running)
    victims: list[Sequence] = []
    if not candidates:  # the common case (one priority): no need to weigh room
        return victims
    while not _room_for(head, victims, running, block_manager, max_num_seqs, max_num_batched_tokens):
        if len(victims) == len(candidates):
            return []
        victims.append(candidates[len(victims)])
    return victims


def _candidates(priority: int, running: list[Sequence]) -> list[Sequence]:
    """Running sequences strictly less urgent than `priority`, in the order to preempt them.
    Beams are left alone: a beam step needs every beam of its request, and parking one for
    a stranger would stall its siblings."""
    ranked = [(s.priority, i, s) for i, s in enumerate(running)
              if s.priority > priority and not s.params.use_beam_search]
    return [s for _, _, s in sorted(ranked, key=lambda r: (r[0], r[1]), reverse=True)]


def _room_for(head: Sequence, victims: list[Sequence], running: list[Sequence], bm: BlockManager,
              max_num_seqs: int, max_num_batched_tokens: int) -> bool:
    """Whether, without `victims`, seats and blocks (not the token budget, which frees itself
    as prompts finish) let `head` be admitted this step after the running sequences' share.
    Blocks shared with others count as staying: an estimate that errs towards fewer victims."""
    if len(running) - len(victims) >= max_num_seqs:
        return False
    gone = {v.seq_id for v in victims}
    budget, needed = max_num_batched_tokens, 0
    for seq in running:  # as the scheduler's running pass will hand out tokens
        if seq.seq_id not in gone and budget > 0:
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needed += bm.blocks_needed(seq, num_new) if num_new else 0
            budget -= num_new
    hit = bm.find_cached_prefix(head)
    if budget <= 0 or hit.pending:  # it waits for the budget or for a prefix, not for room
        return True
    needed += bm.blocks_needed(head, min(head.num_tokens - hit.num_tokens, budget), hit)
    freed = sum(1 for v in victims for b in bm.block_table(v) if bm.blocks[b].ref_count == 1)
    return needed <= bm.num_free_blocks + freed
