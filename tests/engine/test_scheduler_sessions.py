"""Sessions and least-attained-service order, on the real scheduler and block manager (no model): the
service a session has had ranks its next calls in the waiting queue, fresh and light sessions go
ahead of heavy ones, a call that waited too long ranks as fresh again, preempted sequences still
go back first; and end to end on a tiny checkpoint, through LLMEngine and AsyncEngine."""

from __future__ import annotations

from pathlib import Path

import pytest
from parity import hf_greedy
from test_block_manager import step

from streamer import LLM, AsyncEngine, SamplingParams
from streamer.request import Sequence
from streamer.scheduler import Scheduler, SchedulerConfig
from streamer.waiting_queue import AttainedService, WaitingQueue

BS = 4


class Clock:
    """The scheduler's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(max_num_seqs: int = 1, num_blocks: int = 1024, budget: int = 4096, caching: bool = False,
         max_wait_rank_s: float | None = 30.0, clock: Clock | None = None) -> Scheduler:
    config = SchedulerConfig(num_blocks, BS, max_model_len=8192, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=budget, enable_prefix_caching=caching,
                             max_wait_rank_s=max_wait_rank_s)
    return Scheduler(config, clock or Clock())


def call(name: str, n_tokens: int, session: str | None, max_tokens: int = 1000, first: int = 1) -> Sequence:
    prompt = list(range(first, first + n_tokens))
    return Sequence(request_id=name, index=0, token_ids=prompt, num_prompt_tokens=n_tokens,
                    params=SamplingParams(max_tokens=max_tokens), session=session)


def admission_order(sched: Scheduler) -> list[str]:
    """With one seat: step, note who was admitted, finish it, until nobody waits."""
    order = []
    while len(sched.waiting):
        step(sched)
        (admitted,) = sched.running
        order.append(admitted.request_id)
        sched.finish(admitted)
    return order


def test_attained_service_ranks_by_log2_buckets_of_blocks() -> None:
    service = AttainedService(unit=16)
    for session, tokens in (("15", 15), ("16", 16), ("31", 31), ("32", 32), ("4096", 4096)):
        service.add(session, tokens)
    assert [service.rank(s) for s in ("15", "16", "31", "32", "4096", "unknown", None)] == [0, 1, 1, 2, 9, 0, 0]
    service.add(None, 1000)  # no session: nothing to remember
    assert len(service) == 5


def test_attained_service_forgets_the_least_recently_served_session() -> None:
    service = AttainedService(max_sessions=2, unit=1)
    service.add("a", 10)
    service.add("b", 20)
    service.add("a", 5)  # a is now the most recently served
    service.add("c", 1)
    assert (service.tokens("a"), service.tokens("b"), service.tokens("c"), len(service)) == (15, 0, 1, 2)


def test_the_queue_orders_by_priority_then_rank_then_arrival() -> None:
    service = AttainedService(unit=16)
    service.add("heavy", 5000)
    service.add("similar-1", 20)  # 20 and 30 tokens: the same bucket, so arrival decides
    service.add("similar-2", 30)
    q = WaitingQueue(service)
    arrivals = [("heavy", "heavy", 0), ("s2", "similar-2", 0), ("s1", "similar-1", 0), ("anon", None, 0),
                ("urgent-heavy", "heavy", -1)]
    for name, session, priority in arrivals:
        s = call(name, 4, session)
        s.priority = priority
        q.push(s)
    assert [q.pop().request_id for _ in range(len(arrivals))] == ["urgent-heavy", "anon", "s2", "s1", "heavy"]


def test_every_computed_token_counts_and_prefix_hits_do_not() -> None:
    sched = make(budget=4, caching=True)
    long = call("long", 10, "s", max_tokens=3)
    sched.add(long)
    for _ in range(5):  # prompt chunks of 4, 4, 2, then two decodes
        step(sched)
    assert sched.service.tokens("s") == 12 and long.is_finished
    again = call("again", 10, "t", max_tokens=1)  # the same prompt: two full blocks are cached
    sched.add(again)
    for _ in range(3):
        step(sched)
    assert again.num_cached_tokens == 8 and sched.service.tokens("t") == 2
    assert sched.stats()["num_sessions"] == 2


@pytest.mark.parametrize("sessions, expected", [
    (True, ["anon", "fresh", "light-1", "agent-2"]),  # least attained service first
    (False, ["agent-2", "anon", "light-1", "fresh"]),  # no sessions: first come, first served
])
def test_fresh_and_light_sessions_are_admitted_before_a_heavy_one_that_waits(sessions: bool,
                                                                            expected: list[str]) -> None:
    sched = make()

    def session(name: str) -> str | None:
        return name if sessions else None

    sched.add(call("light-0", 8, session("light"), max_tokens=1))
    step(sched)  # 8 tokens: rank 2 in blocks of 4
    sched.add(call("agent-1", 2000, session("agent"), first=100))
    step(sched)  # 2000 tokens: rank 9; it keeps the only seat
    for name, owner in (("agent-2", "agent"), ("anon", None), ("light-1", "light"), ("fresh", "new")):
        sched.add(call(name, 8, session(owner) if owner else None, first=3000))
    assert sched.service.tokens("agent") == (2000 if sessions else 0)
    (running,) = sched.running
    sched.finish(running)
    assert admission_order(sched) == expected


@pytest.mark.parametrize("released_at, max_wait_rank_s, expected", [
    (9.0, 10.0, ["fresh", "agent-2"]),  # not waited long enough: the fresh session overtakes
    (10.0, 10.0, ["agent-2", "fresh"]),  # waited the bound: ranked as fresh, and it came first
    (1000.0, None, ["fresh", "agent-2"]),  # no bound: the rank never expires
])
def test_a_call_that_waited_past_the_bound_ranks_as_fresh(released_at: float, max_wait_rank_s: float | None,
                                                         expected: list[str]) -> None:
    clock = Clock()
    sched = make(max_wait_rank_s=max_wait_rank_s, clock=clock)
    sched.add(call("agent-1", 200, "agent"))
    step(sched)  # agent-1 holds the seat
    sched.add(call("agent-2", 8, "agent", first=300))  # at t=0
    clock.now = 5.0
    sched.add(call("fresh", 8, "new", first=400))
    clock.now = released_at
    (running,) = sched.running
    sched.finish(running)
    assert admission_order(sched) == expected


def test_a_preempted_call_of_a_heavy_session_goes_back_first() -> None:
    sched = make(max_num_seqs=8, num_blocks=3)
    a, heavy = call("a", 4, None), call("heavy", 4, "agent", first=20)
    sched.add(a)
    sched.add(heavy)
    step(sched)  # one block each; agent has 4 tokens of service: rank 1
    fresh = call("fresh", 4, "new", first=40)
    sched.add(fresh)  # rank 0, queued before the preemption
    out = sched.schedule()  # a and heavy each need a second block, one is free: heavy goes
    assert out.preempted == [heavy] and sched.waiting.peek() is heavy


def llama(ckpt: Path) -> LLM:
    return LLM(str(ckpt), dtype="float32", num_kv_blocks=64, max_num_seqs=1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_engine_serves_a_fresh_session_before_a_heavy_one(llama_ckpt: Path) -> None:
    engine = llama(llama_ckpt).engine
    engine.add_request("agent-1", {"prompt_token_ids": list(range(10, 90))}, GREEDY, session="agent")
    while engine.has_unfinished_requests():
        engine.step()
    prompts = {"agent-2": list(range(20, 30)), "chat": list(range(40, 50))}
    engine.add_request("agent-2", {"prompt_token_ids": prompts["agent-2"]}, GREEDY, session="agent")
    engine.add_request("chat", {"prompt_token_ids": prompts["chat"]}, GREEDY, session="chat")
    served, tokens = [], {name: [] for name in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            served += [] if out.request_id in served else [out.request_id]
            tokens[out.request_id] += out.outputs[0].token_ids
    assert served == ["chat", "agent-2"]
    names = list(prompts)
    reference = hf_greedy(llama_ckpt, tuple(tuple(prompts[n]) for n in names), (4, 4), ignore_eos=True)
    assert [tokens[n] for n in names] == reference
    assert engine.stats()["num_sessions"] == 2


@pytest.mark.anyio
async def test_async_engine_passes_the_session_through(llama_ckpt: Path) -> None:
    async with AsyncEngine(llama(llama_ckpt).engine) as engine:
        outputs = [out async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, "r", session="s")]
        assert outputs[-1].finished
        assert engine.engine.scheduler.service.tokens("s") == 3 + 3  # the prompt, then 3 decodes
