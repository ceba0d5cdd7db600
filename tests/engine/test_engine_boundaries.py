"""Edges where off-by-one bugs live: the model's length limit, exactly full blocks, preemption
order and a preempted request's place in the queue, and which request is served first."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from parity import hf_greedy
from test_block_manager import make_seq, model_output, step

from streamer import LLM, SamplingParams
from streamer.request import SeqStatus, Sequence
from streamer.scheduler import Scheduler, SchedulerConfig

MAX_LEN = 48
UNBOUNDED = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def short_llm(llama_ckpt: Path) -> LLM:
    return LLM(str(llama_ckpt), dtype="float32", max_model_len=MAX_LEN, block_size=16, num_kv_blocks=64)


@pytest.mark.parametrize("prompt_len", [MAX_LEN - 9, MAX_LEN - 1])
@pytest.mark.parametrize("max_tokens", [None, MAX_LEN + 5])
def test_generation_ends_exactly_at_max_model_len(short_llm: LLM, llama_ckpt: Path, prompt_len: int,
                                                   max_tokens: int | None) -> None:
    prompt = prompt_of(prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = short_llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == MAX_LEN
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(llama_ckpt, (tuple(prompt),), (MAX_LEN - prompt_len,), ignore_eos=True)[0]


def test_prompt_of_max_model_len_is_refused(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_LEN - 1}"):
        short_llm.engine.add_request("full", {"prompt_token_ids": prompt_of(MAX_LEN)}, UNBOUNDED)
    assert not short_llm.engine.has_unfinished_requests()


def test_parameters_that_would_break_a_step_are_refused_or_harmless(short_llm: LLM) -> None:
    """A request must never crash the step it shares with others: stop token ids index the logits
    (refused at admission when outside the vocabulary); any top_k is valid (capped at the vocabulary)."""
    engine, vocab = short_llm.engine, short_llm.engine.model_config.hf_config.vocab_size
    with pytest.raises(ValueError, match=f"stop token id {vocab} is outside the vocabulary"):
        engine.add_request("poison", {"prompt_token_ids": [5, 6]}, SamplingParams(min_tokens=2, stop_token_ids=[vocab]))
    assert not engine.has_unfinished_requests()
    huge_k = SamplingParams(top_k=2**64, top_p=0.9, seed=1, max_tokens=4, stop_token_ids=[vocab - 1], min_tokens=2)
    outs = short_llm.generate([{"prompt_token_ids": prompt_of(5)}] * 2, huge_k)
    assert all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 4 for o in outs)
    off = SamplingParams(top_k=-1, top_p=0.9, seed=1, max_tokens=4, stop_token_ids=[vocab - 1], min_tokens=2)
    assert [o.outputs[0].token_ids for o in short_llm.generate([{"prompt_token_ids": prompt_of(5)}], off)] == \
        [outs[0].outputs[0].token_ids]  # top_k beyond the vocabulary is top_k off
    with pytest.raises(ValueError, match="at most 1024 stop_token_ids"):
        SamplingParams(stop_token_ids=list(range(1025)))


def test_max_tokens_is_exact(short_llm: LLM) -> None:
    for n in (1, 2, 7):
        out = short_llm.generate({"prompt_token_ids": prompt_of(5)}, SamplingParams(temperature=0.0, max_tokens=n,
                                                                                     ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == n and out.outputs[0].finish_reason == "length"


def test_blocks_filled_exactly(llama_ckpt: Path) -> None:
    """A prompt of exactly two blocks holds two blocks until its first generated token is computed,
    then three; the tokens across the boundary are transformers' tokens."""
    llm = LLM(str(llama_ckpt), dtype="float32", block_size=16, num_kv_blocks=64)
    engine = llm.engine
    prompt = prompt_of(32, seed=3)
    engine.add_request("exact", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=20,
                                                                             ignore_eos=True))
    used, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
        used.append(engine.stats()["kv_blocks_used"])
    # computed tokens after step k: 32, 33, ..., 51; the last step frees everything
    assert used[:-1] == [-(-(32 + k) // 16) for k in range(19)] and used[-1] == 0
    assert tokens == hf_greedy(llama_ckpt, (tuple(prompt),), (20,), ignore_eos=True)[0]


# ---- scheduler: preemption and queue order -----------------------------------------------------
def scheduler(num_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks, block_size=4, max_model_len=1000, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=1000, enable_prefix_caching=False,
                                     max_waiting_requests=100))


def run_step(sched: Scheduler) -> list[Sequence]:
    """One engine step as the scheduler sees it: compute what was scheduled, sample a token."""
    out, _ = step(sched)
    return [item.seq for item in out.scheduled]


def named(n_tokens: int, name: str, priority: int = 0) -> Sequence:
    seq = make_seq(n_tokens)
    seq.request_id, seq.priority = name, priority
    return seq


def test_most_recently_admitted_is_preempted_and_goes_back_to_the_head_of_the_queue() -> None:
    sched = scheduler(num_blocks=6)
    a, b, c = named(8, "a"), named(8, "b"), named(4, "c")
    for seq in (a, b, c):
        sched.add(seq)
    assert run_step(sched) == [a, b, c]  # 2 + 2 + 1 blocks of 6; each now has one token to compute
    late = named(4, "late")
    sched.add(late)  # arrives before the preemption, so it is ahead of c in arrival order
    out = sched.schedule()  # a and b each need a third block, c a second: only 1 is free
    assert out.preempted == [c]
    assert [s.seq for s in out.scheduled] == [a, b]
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0 and sched.block_manager.block_table(c) == []
    assert sched.waiting.peek() is c and len(sched.waiting) == 2
    sched.update_from_output(out, model_output(out))
    sched.finish(a)
    sched.finish(b)
    assert [s.request_id for s in run_step(sched)] == ["c", "late"]


def test_preempted_request_is_served_before_later_arrivals_one_at_a_time() -> None:
    """With room for one sequence at a time, the preempted one runs next, before older waiters."""
    sched = scheduler(num_blocks=3, max_num_seqs=8)
    a, b = named(4, "a"), named(4, "b")
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [a, b]  # one block each, one spare
    waiter = named(8, "waiter")
    sched.add(waiter)
    out = sched.schedule()  # a and b each need a second block, only one is free: b is preempted
    assert out.preempted == [b]
    sched.update_from_output(out, model_output(out))
    sched.finish(a)
    admitted = run_step(sched)
    assert admitted[0] is b


@pytest.mark.parametrize("arrivals", [
    [("low", 5), ("high", 0), ("mid", 2)],
    [("high", 0), ("mid", 2), ("low", 5)],
    [("mid", 2), ("low", 5), ("high", 0)],
    [("first", 1), ("second", 1), ("third", 1)],
])
def test_requests_are_served_by_priority_then_arrival(llama_ckpt: Path, arrivals: list[tuple[str, int]]) -> None:
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    for name, priority in arrivals:
        engine.add_request(name, {"prompt_token_ids": prompt_of(5)}, SamplingParams(max_tokens=2), priority=priority)
    served = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in served:
                served.append(out.request_id)
    assert served == [name for name, _ in sorted(arrivals, key=lambda a: a[1])]
