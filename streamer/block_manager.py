"""Paged KV-cache memory: fixed-size blocks, per-sequence block tables, reference counts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from streamer.request import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0


class BlockManager:
    """Owns the physical blocks. A sequence holds blocks for the tokens it has (or is about to
    have) in the cache, allocated on demand, so only its last block can be partly empty.
    Reference counts let several sequences share a block (prefix sharing, forks)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens; False if there aren't."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block = self.blocks[self.free_block_ids.popleft()]
            assert block.ref_count == 0
            block.ref_count = 1
            seq.block_ids.append(block.block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody references return to the free list."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than owned"
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        seq.block_ids = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def utilization(self, seqs: list[Sequence]) -> float:
        """Token slots holding tokens / token slots allocated, over the given sequences."""
        held = sum(s.num_computed_tokens for s in seqs)
        allocated = sum(len(s.block_ids) for s in seqs) * self.block_size
        return held / allocated if allocated else 0.0
