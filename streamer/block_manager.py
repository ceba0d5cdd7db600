"""Paged KV-cache memory: fixed-size blocks, the block table and block hashes of every sequence,
reference counts, automatic prefix caching and copy-on-write.

A full block is identified by a chained hash of its parent block's hash and its own token ids
(128-bit BLAKE2b: collisions are not a practical concern). Blocks nobody references stay cached
in an LRU free queue until they are needed for new tokens: eviction is lazy and O(1).

The block manager is the only owner of block tables: the scheduler asks it for room, and hands
the tables it returns to the model runner.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from streamer.request import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


@dataclass
class PrefixHit:
    """Cached full blocks that start a sequence: found by `find_cached_prefix`, taken by `allocate`."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    # The sequence's next full block is being computed by a running prompt right now: waiting
    # one step and hitting it beats computing the same tokens twice.
    pending: bool = False
    full_hashes: list[bytes] = field(default_factory=list)  # of every full block: what it promises


def chain_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class BlockManager:
    """Owns the physical blocks and, per sequence id, the blocks each sequence holds for the
    tokens it has (or is about to have) in the cache, allocated on demand, so only its last block
    can be partly empty."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first; cached ones can still be revived.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.tables: dict[int, list[int]] = {}  # seq_id -> block ids
        self.hashes: dict[int, list[bytes]] = {}  # seq_id -> chain hashes of its full computed blocks
        # Full blocks that running prompts are still computing: hash -> the seq_id computing it.
        self.promised: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write, for the next step
        # seq_id -> how many leading entries of its table it no longer holds (release_outside_window):
        # their ids stay in the table, never attended to, so that positions keep their blocks' indices.
        self.released: dict[int, int] = {}

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free_queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def block_table(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds, in token order (empty when it holds none)."""
        return self.tables.get(seq.seq_id, [])

    def block_hashes(self, seq: Sequence) -> list[bytes]:
        return self.hashes.get(seq.seq_id, [])

    # ---- prefix cache ------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached run of full blocks that starts a sequence holding no blocks yet.
        Changes nothing. At least one token is always left to compute, so the model still
        produces the next token's logits."""
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.seq_id in self.tables:
            return PrefixHit()
        hashes = self._full_block_hashes(seq, [], seq.num_tokens)
        hits: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        pending = len(hits) < len(hashes) and hashes[len(hits)] in self.promised
        return PrefixHit(hits, hashes[:len(hits)], len(hits) * self.block_size, pending, hashes)

    def _full_block_hashes(self, seq: Sequence, known: list[bytes], num_tokens: int) -> list[bytes]:
        hashes = list(known)
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            # An adapter's sequences start their chain from the adapter's key: the same tokens under
            # another adapter (or none) have other K/V, so they must never share blocks.
            root = seq.lora.cache_key() if seq.lora is not None else None
            hashes.append(chain_hash(hashes[-1] if hashes else root, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the computed tokens have filled since the last call."""
        if not self.enable_prefix_caching:
            return
        known = self.hashes.get(seq.seq_id, [])
        start = len(known)
        hashes = self.hashes[seq.seq_id] = self._full_block_hashes(seq, known, seq.num_computed_tokens)
        table = self.tables[seq.seq_id]
        for i in range(start, len(hashes)):
            block = self.blocks[table[i]]
            if self.promised.get(hashes[i]) == seq.seq_id:
                del self.promised[hashes[i]]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block.block_id

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix that no sequence holds (benchmarks between repeats, or an
        operator after changing weights). Held blocks keep their hashes. Returns how many went."""
        dropped = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    # ---- allocation --------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks that `allocate(seq, num_new_tokens, hit)` would take (a cached hit that
        nobody references sits in the free queue, so reviving it takes one too)."""
        return self._plan(seq, self.block_table(seq), num_new_tokens, hit)[0]

    def _plan(self, seq: Sequence, table: list[int], num_new_tokens: int, hit: PrefixHit | None
              ) -> tuple[int, bool]:
        """(free blocks needed, whether the shared last block must be copied first)."""
        if hit is not None and hit.block_ids:
            total = hit.num_tokens + num_new_tokens
            revived = sum(1 for b in hit.block_ids if self.blocks[b].ref_count == 0)
            return -(-total // self.block_size) - len(hit.block_ids) + revived, False
        total = seq.num_computed_tokens + num_new_tokens
        copy = self._needs_copy(seq, table)
        return max(0, -(-total // self.block_size) - len(table)) + copy, copy

    def _needs_copy(self, seq: Sequence, table: list[int]) -> bool:
        """The next token goes into a partly filled block that another sequence shares."""
        pos = seq.num_computed_tokens
        if pos % self.block_size == 0 or pos // self.block_size >= len(table):
            return False
        return self.blocks[table[pos // self.block_size]].ref_count > 1

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens, after the cached `hit`
        (for a sequence holding none yet): all of it, or nothing and False. A shared, partly
        filled last block is copied first (copy-on-write)."""
        needed, copy = self._plan(seq, self.block_table(seq), num_new_tokens, hit)
        if needed > self.num_free_blocks:
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        computed = seq.num_computed_tokens
        if hit is not None:
            self._promise(seq, hit)
        if hit is not None and hit.block_ids:
            for block_id in hit.block_ids:
                self._ref(block_id)
            table.extend(hit.block_ids)
            self.hashes[seq.seq_id] = list(hit.block_hashes)
            computed = hit.num_tokens
        elif copy:
            index = computed // self.block_size
            shared = table[index]
            table[index] = self._take_free()
            self.blocks[shared].ref_count -= 1
            self.pending_copies.append((shared, table[index]))
        while len(table) * self.block_size < computed + num_new_tokens:
            table.append(self._take_free())
        return True

    def _promise(self, seq: Sequence, hit: PrefixHit) -> None:
        """A prompt starting to compute announces the full blocks it will fill, so that prompts
        sharing them wait for them instead of computing them again (`PrefixHit.pending`)."""
        for h in hit.full_hashes[len(hit.block_ids):]:
            if h not in self.cached:
                self.promised.setdefault(h, seq.seq_id)

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
        table = self.block_table(parent)
        released = self.released.get(parent.seq_id, 0)
        for block_id in table[released:]:
            self._ref(block_id)
        if released:
            self.released[child.seq_id] = released
        self.tables[child.seq_id] = list(table)
        self.hashes[child.seq_id] = list(self.block_hashes(parent))

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Unreferenced blocks join the free queue tail-first,
        so a sequence's later blocks are evicted before its earlier (more shareable) ones."""
        released = self.released.pop(seq.seq_id, 0)
        for block_id in reversed(self.tables.pop(seq.seq_id, [])[released:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than owned"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        self.hashes.pop(seq.seq_id, None)
        if self.promised:  # a prompt freed before finishing breaks its promises
            self.promised = {h: owner for h, owner in self.promised.items() if owner != seq.seq_id}

    def release_outside_window(self, seq: Sequence, window: int) -> int:
        """Drop `seq`'s references to the blocks wholly before the sliding window of every token it
        has still to compute (a model whose every layer attends to its last `window` keys only:
        the token at position p reads keys > p - window, and p never falls below the next token to
        compute). Their table entries stay, so later positions keep their blocks; no key of theirs is
        attended to again (the CPU prefill kernel may still read some in the tile that starts a
        window, and masks them). A cached block keeps its hash in the free queue. Returns how many
        were released."""
        table = self.tables.get(seq.seq_id)
        if not table:
            return 0
        done = self.released.get(seq.seq_id, 0)
        outside = min(len(table), max(0, seq.num_computed_tokens - window + 1) // self.block_size)
        for block_id in table[done:outside]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        if outside > done:
            self.released[seq.seq_id] = outside
        return max(0, outside - done)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def utilization(self, seqs: list[Sequence]) -> float:
        """Token slots holding tokens / token slots allocated, over distinct physical blocks."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for s in seqs:
            for i, block_id in enumerate(self.block_table(s)):
                if i < self.released.get(s.seq_id, 0):
                    continue
                held = min(bs, max(0, s.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), held)
        return sum(filled.values()) / (len(filled) * bs) if filled else 0.0
