"""Block manager and scheduler invariants under random workloads (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamer.block_manager import BlockManager, chain_hash
from streamer.detokenizer import IncrementalDetokenizer
from streamer.request import SeqStatus, Sequence
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler

NUM_BLOCKS, BLOCK_SIZE = 24, 4


def make_seq(n_tokens: int, first: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=1000)
    prompt = list(range(first, first + n_tokens))
    return Sequence(request_id=f"r{n_tokens}", index=0, token_ids=prompt, num_prompt_tokens=n_tokens,
                    params=params, detokenizer=IncrementalDetokenizer(None, prompt, params))


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the real scheduler + block manager with prefix caching: add (prompts from a few
    shared starts, so cache hits happen), step (compute and append a token), fork, abort."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.sched = Scheduler(self.bm, max_num_seqs=6, max_num_batched_tokens=10, max_model_len=60,
                               max_waiting_requests=100, max_waiting_tokens=None)
        self.live: list[Sequence] = []

    @rule(n=st.integers(1, 30), first=st.sampled_from([1, 1, 5]))
    def add(self, n: int, first: int) -> None:
        seq = make_seq(n, first)
        self.sched.add(seq)
        self.live.append(seq)

    @rule()
    def step(self) -> None:
        out = self.sched.schedule()
        assert out.num_tokens <= 10
        for item in out.scheduled:
            seq = item.seq
            assert len(seq.block_ids) * BLOCK_SIZE >= seq.num_computed_tokens + item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_full_blocks(seq)
            if item.samples:
                seq.token_ids.append(7)
                if seq.num_tokens >= 40:
                    self.sched.finish(seq)
                    self.live.remove(seq)

    @precondition(lambda self: any(s.status is SeqStatus.RUNNING for s in self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from([s for s in self.live if s.status is SeqStatus.RUNNING]))
        child = make_seq(1)
        child.token_ids = list(parent.token_ids)
        child.num_prompt_tokens = parent.num_prompt_tokens
        self.bm.fork(parent, child)
        self.sched.start_running(child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.sched.finish(seq)
        self.live.remove(seq)

    @invariant()
    def blocks_are_owned_exactly(self) -> None:
        owners = Counter(b for s in self.live for b in s.block_ids)
        for block in self.bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)
        free = list(self.bm.free_block_ids)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert set(free).isdisjoint(owners), "a block is both free and owned"
        assert len(free) + len(owners) == NUM_BLOCKS, "a block leaked"

    @invariant()
    def only_last_block_partly_empty(self) -> None:
        # Blocks are taken exactly for the tokens computed so far: no block is ever empty.
        for s in self.live:
            assert len(s.block_ids) == -(-s.num_computed_tokens // BLOCK_SIZE)

    @invariant()
    def cache_index_is_consistent(self) -> None:
        for h, block_id in self.bm.cached.items():
            assert self.bm.blocks[block_id].block_hash == h

    def teardown(self) -> None:
        for seq in list(self.live):
            self.sched.finish(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_allocation_on_demand_and_utilization() -> None:
    bm = BlockManager(8, 4)
    seq = make_seq(5)
    assert bm.allocate(seq, 5) and len(seq.block_ids) == 2
    seq.num_computed_tokens = 5
    assert bm.allocate(seq, 1) and len(seq.block_ids) == 2  # position 5 still fits block 1
    seq.num_computed_tokens = 6
    assert bm.utilization([seq]) == 6 / 8
    assert bm.allocate(seq, 3) and len(seq.block_ids) == 3
    assert not bm.allocate(make_seq(30), 30)  # needs 8 blocks, only 5 free: nothing taken
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def computed(bm: BlockManager, seq: Sequence, n: int) -> Sequence:
    """Allocate and compute `n` more tokens of `seq`, registering its full blocks."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return seq


def test_chain_hash_depends_on_parent_tokens_and_order() -> None:
    base = chain_hash(None, [1, 2, 3, 4])
    assert base == chain_hash(None, [1, 2, 3, 4])
    assert len({base, chain_hash(None, [4, 3, 2, 1]), chain_hash(base, [1, 2, 3, 4]),
                chain_hash(None, [1, 2, 3, 5]), chain_hash(None, [1, 2, 3, 4 + 256]),
                chain_hash(chain_hash(None, [9]), [1, 2, 3, 4])}) == 6


def test_match_prefix_takes_the_longest_run_of_cached_full_blocks() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = computed(bm, make_seq(10), 10)  # blocks [1-4], [5-8] full; [9, 10] partial
    assert first.block_hashes == [chain_hash(None, [1, 2, 3, 4]),
                                  chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])]
    same = make_seq(12)
    assert bm.match_prefix(same) == 8 and same.block_ids == first.block_ids[:2]
    assert same.num_computed_tokens == 8 and same.block_hashes == first.block_hashes
    assert [bm.blocks[b].ref_count for b in first.block_ids] == [2, 2, 1]
    other_start = make_seq(12)
    other_start.token_ids[0] = 99  # first block differs: its later blocks never match
    assert bm.match_prefix(other_start) == 0 and other_start.block_ids == []
    assert bm.match_prefix(same) == 0, "a sequence that already holds blocks is not matched again"


def test_match_prefix_leaves_one_token_to_compute_and_does_nothing_without_caching() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    computed(bm, make_seq(8), 8)
    exact = make_seq(8)
    assert bm.match_prefix(exact) == 4 and len(exact.block_ids) == 1
    plain = BlockManager(16, 4, enable_prefix_caching=False)
    computed(plain, make_seq(8), 8)
    assert plain.cached == {}
    fresh = make_seq(8)
    assert plain.match_prefix(fresh) == 0 and fresh.block_ids == [] and fresh.num_computed_tokens == 0


def test_a_cached_block_keeps_its_first_owner() -> None:
    """Two sequences computing the same block in parallel: the index keeps the first one's block."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a, b = make_seq(4), make_seq(4)
    assert bm.allocate(a, 4) and bm.allocate(b, 4)
    for s in (a, b):
        s.num_computed_tokens = 4
        bm.cache_full_blocks(s)
    h = chain_hash(None, [1, 2, 3, 4])
    first_owner = a.block_ids[0]
    assert bm.cached == {h: first_owner}
    assert bm.blocks[first_owner].block_hash == h and bm.blocks[b.block_ids[0]].block_hash is None
    bm.free(a)
    bm.free(b)
    c = make_seq(6)
    assert bm.match_prefix(c) == 4 and c.block_ids == [first_owner]


def test_copy_on_write_of_a_shared_partial_block() -> None:
    bm = BlockManager(8, 4)
    parent = computed(bm, make_seq(6), 6)  # blocks: one full, one holding 2 of 4
    child = make_seq(6)
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids and child.num_computed_tokens == 6
    assert [bm.blocks[b].ref_count for b in parent.block_ids] == [2, 2]
    shared_full, shared_partial = parent.block_ids
    assert bm.blocks_needed(child, 1) == 1  # no new block for the token, one for the copy
    assert bm.allocate(child, 1)
    assert child.block_ids[0] == shared_full and child.block_ids[1] not in parent.block_ids
    assert bm.take_copies() == [(shared_partial, child.block_ids[1])] and bm.take_copies() == []
    assert bm.blocks[shared_partial].ref_count == 1 and bm.blocks[shared_full].ref_count == 2
    assert bm.blocks_needed(parent, 1) == 0  # the parent owns its partial block alone again
    assert bm.allocate(parent, 1) and bm.take_copies() == []


def test_no_copy_when_the_next_token_starts_a_new_block() -> None:
    bm = BlockManager(8, 4)
    parent = computed(bm, make_seq(8), 8)
    child = make_seq(8)
    bm.fork(parent, child)
    assert bm.blocks_needed(child, 1) == 1 and bm.allocate(child, 1)
    assert bm.take_copies() == [] and child.block_ids[:2] == parent.block_ids


def test_a_failed_allocation_takes_nothing() -> None:
    bm = BlockManager(4, 4)
    parent = computed(bm, make_seq(6), 6)
    child = make_seq(6)
    bm.fork(parent, child)
    other = computed(bm, make_seq(8, first=50), 8)
    assert bm.num_free_blocks == 0
    before = (list(child.block_ids), [b.ref_count for b in bm.blocks])
    assert not bm.allocate(child, 1)  # needs a copy and there is no free block
    assert (child.block_ids, [b.ref_count for b in bm.blocks]) == before and bm.take_copies() == []
    assert other.block_ids


def test_reusing_a_cached_free_block_evicts_it_from_the_index() -> None:
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    a = computed(bm, make_seq(4), 4)
    bm.free(a)
    assert len(bm.cached) == 1 and bm.num_free_blocks == 2
    b = computed(bm, make_seq(8, first=40), 8)  # takes both blocks, the cached one last
    assert set(bm.cached.values()) == set(b.block_ids) and chain_hash(None, [1, 2, 3, 4]) not in bm.cached
    assert bm.match_prefix(make_seq(6)) == 0


def test_free_counts_and_double_free() -> None:
    bm = BlockManager(6, 4)
    a = computed(bm, make_seq(9), 9)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 3
    ghost = make_seq(4)
    ghost.block_ids = list(a.block_ids)
    bm.free(a)
    assert bm.num_used_blocks == 0
    with pytest.raises(AssertionError, match="freed more often than owned"):
        bm.free(ghost)


def test_utilization_counts_shared_blocks_once() -> None:
    bm = BlockManager(8, 4)
    parent = computed(bm, make_seq(6), 6)
    child = make_seq(6)
    bm.fork(parent, child)
    assert bm.utilization([parent, child]) == 6 / 8
    assert bm.utilization([]) == 0.0
