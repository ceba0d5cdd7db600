"""Block manager and scheduler invariants under random workloads (hypothesis)."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamer.block_manager import BlockManager
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
