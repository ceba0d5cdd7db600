"""Paged KV-cache memory: fixed-size blocks, per-sequence block tables, reference counts,
automatic prefix caching and copy-on-write.

A full block is identified by a chained hash of its parent block's hash and its own token ids
(128-bit BLAKE2b: collisions are not a practical concern). Blocks nobody references stay cached
in an LRU free queue until they are needed for new tokens: eviction is lazy and O(1).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from streamer.request import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def chain_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class BlockManager:
    """Owns the physical blocks. A sequence holds blocks for the tokens it has (or is about to
    have) in the cache, allocated on demand, so only its last block can be partly empty."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first; cached ones can still be revived.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write, for the next step

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free_queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # ---- prefix cache ------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """On admission of a sequence with nothing computed: take the longest cached run of its
        full blocks. Returns the number of tokens that need no computing. At least one token is
        always left to compute, so the model still produces the next token's logits."""
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_ids:
            return 0
        hashes = self._full_block_hashes(seq, seq.num_tokens)
        hits: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        for block_id in hits:
            self._ref(block_id)
        seq.block_ids = hits
        seq.block_hashes = hashes[: len(hits)]
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        hashes = list(seq.block_hashes)
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the computed tokens have filled since the last call."""
        if not self.enable_prefix_caching:
            return
        start = len(seq.block_hashes)
        seq.block_hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        for i in range(start, len(seq.block_hashes)):
            block = self.blocks[seq.block_ids[i]]
            h = seq.block_hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block.block_id

    # ---- allocation --------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(seq.block_ids))
        return needed + (1 if self._needs_copy(seq) else 0)

    def _needs_copy(self, seq: Sequence) -> bool:
        """The next token goes into a partly filled block that another sequence shares."""
        pos = seq.num_computed_tokens
        if pos % self.block_size == 0 or pos // self.block_size >= len(seq.block_ids):
            return False
        return self.blocks[seq.block_ids[pos // self.block_size]].ref_count > 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens; False if there aren't.
        A shared, partly filled last block is copied first (copy-on-write)."""
        if self.blocks_needed(seq, num_new_tokens) > self.num_free_blocks:
            return False
        if self._needs_copy(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = seq.block_ids[index]
            copy = self._take_free()
            self.blocks[shared].ref_count -= 1
            seq.block_ids[index] = copy
            self.pending_copies.append((shared, copy))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_ids) * self.block_size < total:
            seq.block_ids.append(self._take_free())
        return True

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: it no longer holds that prefix
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (parallel samples, beams)."""
        for block_id in parent.block_ids:
            self._ref(block_id)
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Unreferenced blocks join the free queue tail-first,
        so a sequence's later blocks are evicted before its earlier (more shareable) ones."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than owned"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_ids = []
        seq.block_hashes = []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def utilization(self, seqs: list[Sequence]) -> float:
        """Token slots holding tokens / token slots allocated, over distinct physical blocks."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for s in seqs:
            for i, block_id in enumerate(s.block_ids):
                held = min(bs, max(0, s.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), held)
        return sum(filled.values()) / (len(filled) * bs) if filled else 0.0
