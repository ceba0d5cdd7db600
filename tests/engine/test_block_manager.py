"""Block manager and scheduler invariants under random workloads (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamer.block_manager import BlockManager, chain_hash
from streamer.request import Request, SeqStatus, Sequence
from streamer.sampler import SamplerOutput
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler, SchedulerConfig
from streamer.scheduler_output import SchedulerOutput, StepUpdates

NUM_BLOCKS, BLOCK_SIZE = 24, 4


def make_seq(n_tokens: int, first: int = 1, max_tokens: int = 1000) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    prompt = list(range(first, first + n_tokens))
    return Sequence(request_id=f"r{n_tokens}", index=0, token_ids=prompt, num_prompt_tokens=n_tokens, params=params)


def model_output(out: SchedulerOutput, token: int = 7) -> tuple[list[Sequence], SamplerOutput]:
    """What the model runner would return for `out` if every row sampled `token`: the sequences
    that sample (a sampling row's forked siblings too), in order."""
    sampled = [s for item in out.scheduled if item.samples_next_token for s in (item.seq, *item.forks)]
    n = len(sampled)
    return sampled, SamplerOutput([token] * n, [None] * n, [None] * n)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, StepUpdates]:
    """One engine step without a model: schedule, then update with every sampled token `token`."""
    out = sched.schedule()
    return out, sched.update_from_output(out, model_output(out, token))


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the real scheduler + block manager with prefix caching through its own step
    (schedule, update_from_output): requests of one or more samples (prompts from a few shared
    starts, so cache hits happen; the samples fork), steps, aborts. Sequences end at 40 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(SchedulerConfig(NUM_BLOCKS, BLOCK_SIZE, max_model_len=60, max_num_seqs=6,
                                               max_num_batched_tokens=10, max_waiting_requests=100))
        self.bm = self.sched.block_manager
        self.requests: list[Request] = []
        self.preemptions: Counter[int] = Counter()  # seq_id -> times seen in `preempted`
        self.aborted: set[str] = set()

    @property
    def live(self) -> list[Sequence]:
        return [s for r in self.requests for s in r.sequences if not s.is_finished]

    @rule(n=st.integers(1, 30), first=st.sampled_from([1, 1, 5]), samples=st.sampled_from([1, 1, 2, 3]))
    def add(self, n: int, first: int, samples: int) -> None:
        prompt = list(range(first, first + n))
        params = SamplingParams(max_tokens=40 - n, n=samples)
        rid = f"r{len(self.requests)}"
        seqs = [Sequence(request_id=rid, index=i, token_ids=list(prompt), num_prompt_tokens=n, params=params)
                for i in range(samples)]
        request = Request(rid, prompt, params, seqs)
        self.sched.add_request(request)
        self.requests.append(request)

    @rule()
    def step(self) -> None:
        before = {id(s): s.num_tokens for s in self.live}
        running = {id(s) for s in self.sched.running}
        out, core = step(self.sched)
        assert out.num_tokens <= 10
        if out.preempted:  # blocks ran short (no priorities here): nobody waiting, or just preempted, runs
            kept = running - {id(s) for s in out.preempted}
            assert all(id(item.seq) in kept for item in out.scheduled), "a step that preempts admitted"
        self.preemptions.update(s.seq_id for s in out.preempted)
        for item in out.scheduled:
            assert len(item.block_ids) * BLOCK_SIZE >= item.seq.num_computed_tokens, "a token has no slot"
        for update in core.updates:
            assert update.seq.num_tokens == before.get(id(update.seq), update.seq.num_prompt_tokens) + 1
            assert (update.finish_reason == "length") == (update.seq.num_tokens >= 40)
            assert update.seq.is_finished == (update.finish_reason is not None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.requests if not r.is_finished]))
        assert self.sched.abort_request(request.request_id) is request
        self.aborted.add(request.request_id)
        assert request.is_finished and request.request_id not in self.sched.requests

    @invariant()
    def blocks_are_owned_exactly(self) -> None:
        owners = Counter(b for s in self.live for b in self.bm.block_table(s))
        for block in self.bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)
        free = list(self.bm.free_block_ids)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert set(free).isdisjoint(owners), "a block is both free and owned"
        assert len(free) + len(owners) == NUM_BLOCKS, "a block leaked"
        assert set(self.bm.tables) <= {s.seq_id for s in self.live}, "a finished sequence still has a table"
        assert set(self.bm.hashes) <= set(self.bm.tables), "a sequence without blocks still has block hashes"

    @invariant()
    def only_last_block_partly_empty(self) -> None:
        # Blocks are taken exactly for the tokens computed so far: no block is ever empty.
        for s in self.live:
            assert len(self.bm.block_table(s)) == -(-s.num_computed_tokens // BLOCK_SIZE)

    @invariant()
    def preemptions_are_counted(self) -> None:
        for s in self.live:
            assert s.num_preemptions == self.preemptions[s.seq_id]
        assert self.sched.counters.num_preemptions == sum(self.preemptions.values())

    @invariant()
    def finished_and_aborted_requests_are_counted_apart(self) -> None:
        done = [r for r in self.requests if r.is_finished and r.request_id not in self.aborted]
        assert self.sched.counters.num_requests_finished == len(done)
        assert self.sched.counters.num_requests_aborted == len(self.aborted)
        assert set(self.sched.requests) == {r.request_id for r in self.requests if not r.is_finished}

    @invariant()
    def forks_wait_only_for_live_sequences(self) -> None:
        assert set(self.sched._forks) <= {s.seq_id for s in self.live if s.index == 0}

    @invariant()
    def cache_index_is_consistent(self) -> None:
        for h, block_id in self.bm.cached.items():
            assert self.bm.blocks[block_id].block_hash == h

    @invariant()
    def only_running_prompts_promise_uncached_blocks(self) -> None:
        """A promise (a block a running prompt will compute, which others wait for) never
        outlives its sequence or its block, so nobody waits for a block that is not coming."""
        running = {s.seq_id: s for s in self.sched.running}
        for h, owner in self.bm.promised.items():
            assert owner in running, "a promise outlived its sequence"
            assert h not in self.bm.cached, "a promise for a block that is already cached"
            assert h not in self.bm.block_hashes(running[owner]), "a promise for a block it computed"

    @invariant()
    def every_live_sequence_is_queued_running_or_waiting_to_fork(self) -> None:
        running = {id(s) for s in self.sched.running}
        waiting = {id(s) for s in self.sched.waiting}
        for s in self.live:
            assert (id(s) in running) == (s.status is SeqStatus.RUNNING)
            if s.status is SeqStatus.WAITING and id(s) not in waiting:
                assert s.index > 0 and s.num_computed_tokens == 0, "only a sample still to be forked waits unqueued"
        assert len(running) + len(waiting) <= len(self.live), "a finished sequence is still queued"

    def teardown(self) -> None:
        for request in self.requests:
            self.sched.abort_request(request.request_id)
        assert self.bm.num_free_blocks == NUM_BLOCKS and not self.sched.requests


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_allocation_on_demand_and_utilization() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = make_seq(5)
    assert bm.allocate(seq, 5) and len(bm.block_table(seq)) == 2
    seq.num_computed_tokens = 5
    assert bm.allocate(seq, 1) and len(bm.block_table(seq)) == 2  # position 5 still fits block 1
    seq.num_computed_tokens = 6
    assert bm.utilization([seq]) == 6 / 8
    assert bm.allocate(seq, 3) and len(bm.block_table(seq)) == 3
    assert bm.utilization([seq]) == 6 / 12  # the block taken ahead holds nothing yet
    assert not bm.allocate(make_seq(30), 30)  # needs 8 blocks, only 5 free: nothing taken
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.block_table(seq) == []


def computed(bm: BlockManager, seq: Sequence, n: int) -> Sequence:
    """Allocate and compute `n` more tokens of `seq`, registering its full blocks."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return seq


def fork(bm: BlockManager, parent: Sequence, child: Sequence) -> None:
    """Fork as the scheduler does: the child shares the blocks and starts where the parent is."""
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens


def take_prefix(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` with nothing new to compute yet: take its cached prefix, as the scheduler does."""
    hit = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, 0, hit)
    seq.num_computed_tokens = hit.num_tokens
    return hit.num_tokens


def test_finding_a_prefix_changes_nothing_and_taking_it_is_all_or_nothing() -> None:
    bm = BlockManager(5, 4, enable_prefix_caching=True)
    first = computed(bm, make_seq(8), 8)
    bm.free(first)  # both blocks cached, unreferenced, in the free queue
    state = lambda: ([b.ref_count for b in bm.blocks], bm.free_block_ids, dict(bm.cached), dict(bm.tables))  # noqa: E731
    before = state()
    big = make_seq(30)  # its first 8 tokens are cached; 30 tokens need 8 blocks, only 5 exist
    hit = bm.find_cached_prefix(big)
    assert (hit.block_ids, hit.num_tokens) == (bm.block_table(first) or hit.block_ids, 8) and state() == before
    assert bm.blocks_needed(big, 22, hit) == 8 - 2 + 2  # reviving the two cached blocks takes them off the free list
    assert not bm.allocate(big, 22, hit) and state() == before and bm.block_table(big) == []
    fits = make_seq(14)
    hit = bm.find_cached_prefix(fits)
    assert bm.allocate(fits, 6, hit) and bm.block_table(fits)[:2] == hit.block_ids and len(bm.block_table(fits)) == 4
    assert [bm.blocks[b].ref_count for b in bm.block_table(fits)] == [1, 1, 1, 1] and bm.num_free_blocks == 1
    assert bm.block_hashes(fits) == hit.block_hashes


def test_chain_hash_depends_on_parent_tokens_and_order() -> None:
    base = chain_hash(None, [1, 2, 3, 4])
    assert base == chain_hash(None, [1, 2, 3, 4])
    assert len({base, chain_hash(None, [4, 3, 2, 1]), chain_hash(base, [1, 2, 3, 4]),
                chain_hash(None, [1, 2, 3, 5]), chain_hash(None, [1, 2, 3, 4 + 256]),
                chain_hash(chain_hash(None, [9]), [1, 2, 3, 4])}) == 6


def test_match_prefix_takes_the_longest_run_of_cached_full_blocks() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = computed(bm, make_seq(10), 10)  # blocks [1-4], [5-8] full; [9, 10] partial
    assert bm.block_hashes(first) == [chain_hash(None, [1, 2, 3, 4]),
                                  chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])]
    same = make_seq(12)
    assert take_prefix(bm, same) == 8 and bm.block_table(same) == bm.block_table(first)[:2]
    assert same.num_computed_tokens == 8 and bm.block_hashes(same) == bm.block_hashes(first)
    assert [bm.blocks[b].ref_count for b in bm.block_table(first)] == [2, 2, 1]
    other_start = make_seq(12)
    other_start.token_ids[0] = 99  # first block differs: its later blocks never match
    assert take_prefix(bm, other_start) == 0 and bm.block_table(other_start) == []
    assert bm.find_cached_prefix(same).num_tokens == 0, "a sequence that already holds blocks is not matched again"
    taken = make_seq(12)
    assert bm.allocate(taken, 4) and taken.num_computed_tokens == 0  # blocks, nothing computed yet
    assert bm.find_cached_prefix(taken).num_tokens == 0


def test_match_prefix_leaves_one_token_to_compute_and_does_nothing_without_caching() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    computed(bm, make_seq(8), 8)
    exact = make_seq(8)
    assert take_prefix(bm, exact) == 4 and len(bm.block_table(exact)) == 1
    plain = BlockManager(16, 4, enable_prefix_caching=False)
    computed(plain, make_seq(8), 8)
    assert plain.cached == {}
    fresh = make_seq(8)
    assert take_prefix(plain, fresh) == 0 and plain.block_table(fresh) == [] and fresh.num_computed_tokens == 0


def test_a_cached_block_keeps_its_first_owner() -> None:
    """Two sequences computing the same block in parallel: the index keeps the first one's block."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a, b = make_seq(4), make_seq(4)
    assert bm.allocate(a, 4) and bm.allocate(b, 4)
    for s in (a, b):
        s.num_computed_tokens = 4
        bm.cache_full_blocks(s)
    h = chain_hash(None, [1, 2, 3, 4])
    first_owner = bm.block_table(a)[0]
    assert bm.cached == {h: first_owner}
    assert bm.blocks[first_owner].block_hash == h and bm.blocks[bm.block_table(b)[0]].block_hash is None
    bm.free(a)
    bm.free(b)
    c = make_seq(6)
    assert take_prefix(bm, c) == 4 and bm.block_table(c) == [first_owner]


@pytest.mark.parametrize("n", [5, 6, 7])
def test_copy_on_write_of_a_shared_partial_block(n: int) -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = computed(bm, make_seq(n), n)  # blocks: one full, one holding 1 to 3 of 4
    child = make_seq(n)
    fork(bm, parent, child)
    assert bm.block_table(child) == bm.block_table(parent) and child.num_computed_tokens == n
    assert [bm.blocks[b].ref_count for b in bm.block_table(parent)] == [2, 2]
    shared_full, shared_partial = bm.block_table(parent)
    assert bm.blocks_needed(child, 1) == 1  # no new block for the token, one for the copy
    assert bm.allocate(child, 1)
    assert bm.block_table(child)[0] == shared_full and bm.block_table(child)[1] not in bm.block_table(parent)
    assert bm.take_copies() == [(shared_partial, bm.block_table(child)[1])] and bm.take_copies() == []
    assert bm.blocks[shared_partial].ref_count == 1 and bm.blocks[shared_full].ref_count == 2
    assert bm.blocks_needed(parent, 1) == 0  # the parent owns its partial block alone again
    assert bm.allocate(parent, 1) and bm.take_copies() == []


def test_no_copy_when_the_next_token_starts_a_new_block() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = computed(bm, make_seq(8), 8)
    child = make_seq(8)
    fork(bm, parent, child)
    assert bm.blocks_needed(child, 1) == 1 and bm.allocate(child, 1)
    assert bm.take_copies() == [] and bm.block_table(child)[:2] == bm.block_table(parent)


def test_a_failed_allocation_takes_nothing() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    parent = computed(bm, make_seq(6), 6)
    child = make_seq(6)
    fork(bm, parent, child)
    other = computed(bm, make_seq(8, first=50), 8)
    assert bm.num_free_blocks == 0
    before = (list(bm.block_table(child)), [b.ref_count for b in bm.blocks])
    assert not bm.allocate(child, 1)  # needs a copy and there is no free block
    assert (bm.block_table(child), [b.ref_count for b in bm.blocks]) == before and bm.take_copies() == []
    assert bm.block_table(other)


def test_reusing_a_cached_free_block_evicts_it_from_the_index() -> None:
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    a = computed(bm, make_seq(4), 4)
    bm.free(a)
    assert len(bm.cached) == 1 and bm.num_free_blocks == 2
    b = computed(bm, make_seq(8, first=40), 8)  # takes both blocks, the cached one last
    assert set(bm.cached.values()) == set(bm.block_table(b)) and chain_hash(None, [1, 2, 3, 4]) not in bm.cached
    assert take_prefix(bm, make_seq(6)) == 0


def test_free_counts_and_double_free() -> None:
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    a = computed(bm, make_seq(9), 9)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 3
    ghost = make_seq(4)
    bm.tables[ghost.seq_id] = list(bm.block_table(a))
    bm.free(a)
    assert bm.num_used_blocks == 0
    with pytest.raises(AssertionError, match="freed more often than owned"):
        bm.free(ghost)


def test_utilization_counts_shared_blocks_once() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = computed(bm, make_seq(6), 6)
    child = make_seq(6)
    fork(bm, parent, child)
    assert bm.utilization([parent, child]) == 6 / 8
    assert bm.utilization([]) == 0.0
