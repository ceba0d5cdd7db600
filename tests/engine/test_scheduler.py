"""The scheduler's bookkeeping, step by step, on the real block manager (no model): token budget,
sequence cap, waiting-queue bounds and token accounting, prefix-cache counters, aborts."""

from __future__ import annotations

import pytest
import torch
from test_block_manager import make_seq, step

from streamer.errors import QueueFullError
from streamer.request import Request, SeqStatus, Sequence
from streamer.sampler import SamplerOutput
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler, SchedulerConfig
from streamer.waiting_queue import WaitingQueue

BS = 4


def make(num_blocks: int = 32, max_num_seqs: int = 8, budget: int = 100, max_waiting: int = 100,
         max_waiting_tokens: int | None = None, caching: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks, BS, max_model_len=1000, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=budget, enable_prefix_caching=caching,
                                     max_waiting_requests=max_waiting, max_waiting_tokens=max_waiting_tokens))


def seq(n: int, name: str = "", first: int = 1, priority: int = 0) -> Sequence:
    s = make_seq(n, first)
    s.request_id, s.priority = name or f"r{n}", priority
    return s


def advance(sched: Scheduler) -> list[tuple[str, int]]:
    """One step through the scheduler's own update: (request id, tokens) per scheduled row."""
    out, _ = step(sched)
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def test_the_token_budget_chunks_prefills_and_decodes_go_first() -> None:
    sched = make(budget=10)
    a, b = seq(6, "a"), seq(12, "b", first=50)
    sched.add(a)
    sched.add(b)
    assert advance(sched) == [("a", 6), ("b", 4)]  # b's prompt is cut to the remaining budget
    assert advance(sched) == [("a", 1), ("b", 8)]  # running sequences first: a decodes, b goes on
    assert advance(sched) == [("a", 1), ("b", 1)]


def test_the_budget_is_never_exceeded_and_a_full_budget_admits_nobody() -> None:
    sched = make(budget=5)
    sched.add(seq(5, "a"))
    sched.add(seq(3, "b", first=20))
    assert advance(sched) == [("a", 5)]
    assert len(sched.waiting) == 1 and [s.request_id for s in sched.running] == ["a"]


def test_the_last_token_of_the_budget_goes_to_a_running_sequence() -> None:
    sched = make(budget=2)
    sched.add(seq(1, "a"))
    sched.add(seq(1, "b", first=20))
    assert advance(sched) == [("a", 1), ("b", 1)]
    assert advance(sched) == [("a", 1), ("b", 1)]  # b's decode takes the budget's last token
    late = make(budget=3)
    late.add(seq(2, "a"))
    late.add(seq(4, "b", first=20))
    assert advance(late) == [("a", 2), ("b", 1)]  # a waiting prompt starts with the last token


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(2, f"s{i}", first=10 * i + 1))
    assert [name for name, _ in advance(sched)] == ["s0", "s1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_waiting_queue_bounds_count_requests_and_tokens() -> None:
    sched = make(max_waiting=2, max_waiting_tokens=10)
    sched.check_room(2, 5)  # exactly at both limits: fits
    with pytest.raises(QueueFullError, match="2 requests"):
        sched.check_room(3, 1)
    with pytest.raises(QueueFullError, match="10 tokens"):
        sched.check_room(1, 11)
    sched.add(seq(6, "a"))
    assert sched.waiting.num_tokens == 6
    sched.check_room(1, 4)
    with pytest.raises(QueueFullError, match="10 tokens"):
        sched.check_room(1, 5)
    with pytest.raises(QueueFullError, match="2 requests"):
        sched.check_room(2, 1)


def test_waiting_tokens_are_counted_in_and_out() -> None:
    sched = make()
    a, b, c = seq(6, "a"), seq(3, "b", first=20), seq(4, "c", first=40)
    for s in (a, b, c):
        sched.add(s)
    assert sched.waiting.num_tokens == 13
    sched.finish(c)  # aborted while waiting
    assert sched.waiting.num_tokens == 9 and len(sched.waiting) == 2 and c.status is SeqStatus.FINISHED
    advance(sched)
    assert sched.waiting.num_tokens == 0 and not len(sched.waiting)
    sched.finish(a)
    assert a not in sched.running and sched.block_manager.block_table(a) == [] and a.status is SeqStatus.FINISHED


def test_preempted_tokens_count_as_waiting_again() -> None:
    sched = make(num_blocks=3)
    a, b = seq(4, "a"), seq(4, "b", first=20)
    sched.add(a)
    sched.add(b)
    advance(sched)  # one block each; both now hold 5 tokens and need a second block
    out = sched.schedule()
    assert out.preempted == [b] and sched.counters.num_preemptions == 1 and b.num_preemptions == 1
    assert sched.waiting.num_tokens == b.num_tokens == 5


def test_prefix_cache_counters_count_prompts_and_hits() -> None:
    sched = make(caching=True)
    first = seq(10, "first")
    sched.add(first)
    advance(sched)
    sched.finish(first)
    again = seq(10, "again")  # same tokens: two full blocks cached
    sched.add(again)
    advance(sched)
    assert again.num_cached_tokens == 8
    assert sched.counters.prefix_cache_query_tokens == 20 and sched.counters.prefix_cache_hit_tokens == 8
    off = make(caching=False)
    off.add(seq(10, "x"))
    advance(off)
    assert off.counters.prefix_cache_query_tokens == 0 and off.counters.prefix_cache_hit_tokens == 0


def warmed(num_blocks: int) -> Scheduler:
    """A caching scheduler whose cache holds the blocks of an 8-token prompt, all freed."""
    sched = make(num_blocks=num_blocks, caching=True)
    warm = seq(8, "warm")
    sched.add(warm)
    advance(sched)
    sched.finish(warm)
    return sched


def test_a_recomputed_sequence_keeps_its_first_cache_hit_count() -> None:
    """num_cached_tokens reports what the prompt found at first admission, not on a recompute."""
    sched = warmed(num_blocks=4)
    a = seq(8, "a")  # finds one full block (the last is always recomputed)
    b = seq(4, "b", first=30)
    sched.add(b)
    sched.add(a)  # admitted last, so preempted first
    advance(sched)
    assert a.num_cached_tokens == 4
    for _ in range(8):  # grow until the cache is too small for both
        if a.num_preemptions:
            break
        advance(sched)
    assert a.num_preemptions == 1 and a.num_cached_tokens == 4


def test_a_prompt_that_does_not_fit_gives_its_prefix_hits_back() -> None:
    sched = warmed(num_blocks=3)
    big = seq(14, "big")  # shares the first block; needs 4 blocks of 3
    sched.add(big)
    assert advance(sched) == []
    bm = sched.block_manager
    assert big.num_computed_tokens == 0 and bm.block_table(big) == [] and bm.num_free_blocks == 3
    assert sched.waiting.peek() is big


def test_waiting_queue_orders_by_priority_then_arrival_and_removes() -> None:
    q = WaitingQueue()
    a, b, c, d = (seq(1, n, priority=p) for n, p in (("a", 1), ("b", 0), ("c", 1), ("d", 0)))
    for s in (a, b, c, d):
        q.push(s)
    preempted = seq(1, "p", priority=1)
    q.push(preempted, front=True)
    assert q.remove(c) and not q.remove(c) and len(q) == 4
    assert set(q) == {a, b, d, preempted}
    assert [q.pop().request_id for _ in range(4)] == ["b", "d", "p", "a"]


def request(name: str, n_tokens: int, samples: int = 1, first: int = 1, **params: object) -> Request:
    prompt = list(range(first, first + n_tokens))
    p = SamplingParams(**{"max_tokens": 1000, "n": samples, **params})
    return Request(name, prompt, p, [Sequence(request_id=name, index=i, token_ids=list(prompt),
                                              num_prompt_tokens=n_tokens, params=p) for i in range(samples)])


@pytest.mark.parametrize("num_blocks, capacity", [(7, 0), (8, 1)])
def test_admission_capacity_is_none_while_some_wait_or_blocks_are_short(num_blocks: int, capacity: int) -> None:
    sched = make(num_blocks=num_blocks, max_num_seqs=4, max_waiting=2)
    assert sched.admission_capacity() == 2  # min(4 free sequence slots, 2 waiting places)
    sched.add(seq(4, "a"))
    assert sched.admission_capacity() == 0  # one waits already
    advance(sched)
    assert sched.admission_capacity() == 2  # 1 running, plenty of blocks: min(3 slots, 2 places)
    sched.add(seq(4, "b", first=20))
    sched.add(seq(4, "c", first=40))
    advance(sched)  # a holds 2 blocks, b and c 1 each
    # 3 running: a 4th request only while the free blocks would give each running one more
    assert sched.block_manager.num_free_blocks == num_blocks - 4 and sched.admission_capacity() == capacity


def test_admission_capacity_is_none_once_every_sequence_slot_runs() -> None:
    sched = make(num_blocks=64, max_num_seqs=2)
    sched.add(seq(4, "a"))
    advance(sched)
    assert sched.admission_capacity() == 1
    sched.add(seq(4, "b", first=20))
    advance(sched)
    assert len(sched.running) == 2 and sched.admission_capacity() == 0


def test_stats_report_queues_blocks_and_counters() -> None:
    sched = make(num_blocks=8)
    sched.add(seq(6, "a"))
    sched.add(seq(3, "b", first=20))
    advance(sched)
    stats = sched.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_total"]) == (2, 0, 8)
    assert stats["num_requests"] == 0  # bare sequences, no request registered
    assert (stats["kv_blocks_used"], stats["kv_blocks_free"]) == (3, 5)  # 6 tokens: 2 blocks, 3: 1
    assert stats["kv_utilization"] == 9 / 12 and stats["num_steps"] == 1
    assert stats["prompt_tokens_computed"] == 9 and stats["generation_tokens"] == 2


def test_samples_fork_from_the_first_once_its_prompt_is_computed_and_finish_counts_once() -> None:
    sched = make(num_blocks=16)
    r = request("r", 6, samples=3, max_tokens=2)
    sched.add_request(r)
    assert list(sched.waiting) == [r.sequences[0]]  # only the first computes the prompt
    out, core = step(sched)
    assert [s.seq for s in out.scheduled] == [r.sequences[0]] and out.scheduled[0].forks == r.sequences[1:]
    assert [u.seq for u in core.updates] == r.sequences and all(s.num_computed_tokens == 6 for s in r.sequences)
    table = sched.block_manager.block_table
    assert table(r.sequences[1]) == table(r.sequences[0]) == table(r.sequences[2])  # shared, not copied
    _, core = step(sched)
    assert [(u.finish_reason, u.seq.num_output_tokens) for u in core.updates] == [("length", 2)] * 3
    assert r.is_finished and "r" not in sched.requests and not sched.has_unfinished_requests()
    assert sched.counters.num_requests_finished == 1 and sched.block_manager.num_free_blocks == 16
    sched.add_request(request("next", 3, max_tokens=1))
    step(sched)
    assert sched.counters.num_requests_finished == 2 and not sched.requests


def test_resumed_samples_each_compute_their_own_tokens() -> None:
    sched = make()
    r = request("r", 4, samples=2)
    r.sequences[1].token_ids += [9, 9]
    sched.add_request(r, resumed=True)
    out, _ = step(sched)
    assert sorted((s.seq.index, s.num_new_tokens, len(s.forks)) for s in out.scheduled) == [(0, 4, 0), (1, 6, 0)]


def test_abort_counts_as_aborted_not_finished_and_frees_everything() -> None:
    sched = make(num_blocks=16)
    r = request("r", 6, samples=2)
    sched.add_request(r)
    step(sched)
    assert sched.abort_request("r") is r and sched.abort_request("r") is None
    assert r.is_finished and not sched.running and not len(sched.waiting)
    assert (sched.counters.num_requests_aborted, sched.counters.num_requests_finished) == (1, 0)
    waiting = request("w", 6, samples=3)  # aborted before its samples fork: none are left to fork
    sched.add_request(waiting)
    assert sched.stats()["num_requests"] == 1
    sched.abort_request("w")
    assert sched.counters.num_requests_aborted == 2 and not sched._forks and not sched.requests
    assert sched.block_manager.num_free_blocks == 16 and not sched.block_manager.tables


def test_a_request_that_does_not_fit_the_queue_is_not_registered() -> None:
    sched = make(max_waiting=1)
    sched.add_request(request("a", 4))
    with pytest.raises(QueueFullError):
        sched.add_request(request("b", 4, first=20))
    assert list(sched.requests) == ["a"] and len(sched.waiting) == 1


def test_the_update_reports_each_sampled_token_with_its_logprobs() -> None:
    sched = make()
    a, b = seq(4, "a"), seq(3, "b", first=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sampled = [a, b]
    result = SamplerOutput([11, 12], [{11: -0.5, 3: -1.5}, None], [None, None])
    core = sched.update_from_output(out, (sampled, result))
    assert [(u.seq, u.token_id, u.logprobs, u.finish_reason) for u in core.updates] == \
        [(a, 11, {11: -0.5, 3: -1.5}, None), (b, 12, None, None)]
    assert a.token_ids[-1] == 11 and b.token_ids[-1] == 12 and not core.beam_results


def test_the_update_applies_the_token_stop_rules() -> None:
    sched = Scheduler(SchedulerConfig(32, BS, max_model_len=1000, eos_token_ids=frozenset({2})))
    for r in (request("eos", 4), request("stop", 4, first=20, stop_token_ids=[9]), request("go", 4, first=40)):
        sched.add_request(r)
    out = sched.schedule()
    sampled = [item.seq for item in out.scheduled]
    core = sched.update_from_output(out, (sampled, SamplerOutput([2, 9, 5], [None] * 3, [None] * 3)))
    assert [(u.seq.request_id, u.finish_reason, u.stop_reason) for u in core.updates] == \
        [("eos", "stop", None), ("stop", "stop", 9), ("go", None, None)]
    assert list(sched.requests) == ["go"] and [s.request_id for s in sched.running] == ["go"]


def test_queue_room_counts_prompt_tokens_and_resumed_samples() -> None:
    sched = make(max_waiting=2, max_waiting_tokens=12)
    with pytest.raises(QueueFullError, match="12 tokens"):
        sched.add_request(request("long", 13))
    sched.add_request(request("forks", 4, samples=3))  # the samples fork later: one waits
    with pytest.raises(QueueFullError, match="2 requests"):
        sched.add_request(request("resumed", 4, samples=2, first=20), resumed=True)  # both wait
    assert list(sched.requests) == ["forks"]


def test_a_beam_waiting_for_its_sibling_is_skipped_not_parked_while_the_sibling_runs() -> None:
    sched = make(budget=4)
    beam = request("beam", 4, use_beam_search=True, beam_width=2, max_tokens=5)
    sched.add_request(beam)
    out = sched.schedule()  # the prompt; its row's log-probs pick two continuations of the one beam
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0]]), dim=-1)
    sched.update_from_output(out, ([beam.sequences[0]], SamplerOutput([1], [None], [logprobs[0]])))
    first, second = beam.sequences
    assert [s.token_ids[-1] for s in beam.sequences] == [1, 2] and sched.running == [first, second]
    sched.config.max_num_batched_tokens = 1  # room for one beam per step
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [first]
    sched.update_from_output(out, ([first], SamplerOutput([0], [None], [logprobs[0]])))
    assert beam.sequences == [first, second] and first.num_computed_tokens == first.num_tokens  # waits
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [second] and out.preempted == []
    assert first.status is SeqStatus.RUNNING


def _shared_prefix_requests(n: int, prefix: int, rng_seed: int = 0) -> list[Sequence]:
    import random

    rng = random.Random(rng_seed)
    shared = [rng.randrange(4, 32000) for _ in range(prefix)]
    seqs = []
    for i in range(n):
        s = make_seq(1)
        s.request_id = f"c{i}"
        s.token_ids = shared + [rng.randrange(4, 32000) for _ in range(rng.randint(8, 32))]
        s.num_prompt_tokens = len(s.token_ids)
        seqs.append(s)
    return seqs


def test_simultaneous_arrivals_share_the_prefix_being_computed() -> None:
    """32 prompts sharing a 200-token prefix arrive at once (block size 16): the first computes
    the prefix, the other 31 wait one step and then hit all 12 of its full blocks: the same
    physical block ids, 31 x 192 hit tokens, and the shared tokens computed once."""
    sched = Scheduler(SchedulerConfig(400, 16, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048))
    seqs = _shared_prefix_requests(32, 200)
    for s in seqs:
        sched.add(s)
    first = [item.seq.request_id for item in step(sched)[0].scheduled]
    assert first == ["c0"]  # the others hold back for one step rather than compute the prefix again
    second = step(sched)[0].scheduled
    assert sorted(item.seq.request_id for item in second) == sorted(f"c{i}" for i in range(32))
    leader_blocks = sched.block_manager.block_table(seqs[0])[:12]
    for s in seqs[1:]:
        assert sched.block_manager.block_table(s)[:12] == leader_blocks
        assert s.num_cached_tokens == 192
    assert sched.counters.prefix_cache_hit_tokens == 31 * 192
    computed = sum(item.num_new_tokens for item in second if item.seq is not seqs[0])
    assert computed == sum(s.num_prompt_tokens - 192 for s in seqs[1:])
    assert sched.block_manager.promised == {}


def test_a_prompt_waits_for_a_chunked_prefix_and_a_preempted_leader_releases_it() -> None:
    """A shared prefix computed over several chunks keeps its followers waiting until it is
    cached; if the leader loses its blocks first, the followers stop waiting."""
    sched = Scheduler(SchedulerConfig(400, 16, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=64))
    leader, follower = _shared_prefix_requests(2, 200)
    sched.add(leader)
    sched.add(follower)
    for _ in range(3):  # 64-token chunks of the leader; the follower waits
        assert [item.seq for item in step(sched)[0].scheduled] == [leader]
    assert sched.block_manager.promised  # blocks 12 of the prefix are not computed yet
    sched.finish(leader)  # freed before its prompt is done (an abort)
    assert sched.block_manager.promised == {}
    scheduled = step(sched)[0].scheduled
    assert [item.seq for item in scheduled] == [follower]
    assert follower.num_cached_tokens == 192  # the 12 blocks the leader did compute (3 x 64 tokens)


def test_a_step_that_preempts_for_blocks_admits_nobody() -> None:
    """Blocks freed by a preemption are not handed to a waiting sequence in the same step: the victim
    would be readmitted (recomputed) at once, or another admitted only to be preempted next."""
    sched = make(num_blocks=2, budget=2)
    sched.add(seq(6, "a"))
    sched.add(seq(1, "c", first=50))
    for _ in range(8):
        running = list(sched.running)
        out, _ = step(sched)
        if out.preempted:
            break
    assert [s.request_id for s in out.preempted] == ["a"]
    kept = [s for s in running if s not in out.preempted]
    assert [item.seq for item in out.scheduled] == kept  # nobody else, and not the victim again
    assert sched.waiting.peek().request_id == "a"
