"""Priority preemption, on the real scheduler and block manager (no model): a waiting sequence more
urgent than running ones that finds no seat or no blocks preempts the least urgent (latest admitted
first among equals), never one of its own or a more urgent priority, never a beam, and nobody when
even every candidate would not make room; end to end, the preempted request's output is still
transformers' output."""

from __future__ import annotations

from pathlib import Path

import torch
from parity import hf_greedy
from test_block_manager import step

from streamer import LLM, SamplingParams
from streamer.request import Request, SeqStatus, Sequence
from streamer.sampler import SamplerOutput
from streamer.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(max_num_seqs: int = 8, num_blocks: int = 64, budget: int = 100) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks, BS, max_model_len=1000, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=budget, enable_prefix_caching=False))


def seq(name: str, n_tokens: int, priority: int, first: int = 1, **params: object) -> Sequence:
    prompt = list(range(first, first + n_tokens))
    return Sequence(request_id=name, index=0, token_ids=prompt, num_prompt_tokens=n_tokens,
                    params=SamplingParams(**{"max_tokens": 1000, **params}), priority=priority)


def running(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit `seqs` in this order and compute their prompts, in one step."""
    for s in seqs:
        sched.add(s)
    step(sched)
    assert sched.running == list(seqs)


def scheduled(sched: Scheduler) -> tuple[list[str], list[str]]:
    """One step: (who was preempted, who runs), by request id."""
    out, _ = step(sched)
    return [s.request_id for s in out.preempted], [item.seq.request_id for item in out.scheduled]


def test_no_seat_preempts_the_latest_admitted_of_the_least_urgent_and_admits_at_once() -> None:
    sched = make(max_num_seqs=2)
    a, b = seq("a", 4, priority=5), seq("b", 4, priority=5, first=20)
    running(sched, a, b)
    sched.add(seq("urgent", 4, priority=0, first=40))
    assert scheduled(sched) == (["b"], ["a", "urgent"])
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and sched.waiting.peek() is b
    assert (sched.counters.num_priority_preemptions, sched.counters.num_preemptions) == (1, 1)
    assert sched.stats()["num_priority_preemptions"] == 1


def test_the_least_urgent_goes_first_and_equal_or_more_urgent_never() -> None:
    sched = make(max_num_seqs=3)
    low, mid, top = seq("low", 4, 5), seq("mid", 4, 2, first=20), seq("top", 4, 0, first=40)
    for s in (low, mid, top):  # one per step, so that low is admitted first: yet the least urgent
        sched.add(s)
        step(sched)
    assert sched.running == [top, mid, low]  # most urgent first, whatever the admission order
    sched.add(seq("p1-a", 4, 1, first=60))
    assert scheduled(sched) == (["low"], ["top", "mid", "p1-a"])
    sched.add(seq("p1-b", 4, 1, first=80))
    assert scheduled(sched) == (["mid"], ["top", "p1-a", "p1-b"])
    sched.add(seq("p1-c", 4, 1, first=100))  # only p0 and p1 run: nobody less urgent to preempt
    assert scheduled(sched) == ([], ["top", "p1-a", "p1-b"])
    assert sched.counters.num_priority_preemptions == 2
    assert sched.waiting.peek().request_id == "p1-c" and {s.request_id for s in sched.waiting} == {"p1-c", "mid", "low"}


def test_equal_priority_waits_its_turn() -> None:
    sched = make(max_num_seqs=1)
    running(sched, seq("first", 4, 3))
    sched.add(seq("second", 4, 3, first=20))
    assert scheduled(sched) == ([], ["first"])
    assert sched.counters.num_priority_preemptions == 0


def test_short_blocks_preempt_just_enough_for_the_urgent_prompt() -> None:
    sched = make(num_blocks=6)
    low1, low2 = seq("low1", 8, 5), seq("low2", 8, 5, first=20)
    running(sched, low1, low2)  # 2 blocks each, and each needs a third for its next token: 2 free
    sched.add(seq("urgent", 12, 0, first=40))  # 3 blocks: low2 going frees 2 and needs none
    assert scheduled(sched) == (["low2"], ["low1", "urgent"])
    assert sched.block_manager.num_free_blocks == 0


def test_nobody_is_preempted_when_even_every_candidate_would_not_make_room() -> None:
    sched = make(num_blocks=6)
    high, low = seq("high", 8, 0), seq("low", 4, 5, first=20)
    running(sched, high, low)  # 3 blocks held, 3 free; each needs one more
    sched.add(seq("big", 20, 1, first=40))  # 5 blocks: 4 at most with low gone
    assert scheduled(sched) == ([], ["high", "low"])
    assert sched.counters.num_preemptions == 0 and sched.waiting.peek().request_id == "big"


def beam_request(name: str, priority: int) -> Request:
    prompt = [1, 2, 3, 4]
    params = SamplingParams(max_tokens=5, use_beam_search=True, beam_width=2)
    first = Sequence(request_id=name, index=0, token_ids=list(prompt), num_prompt_tokens=4, params=params,
                     priority=priority)
    return Request(name, prompt, params, [first])


def with_two_beams(max_num_seqs: int, plain: Sequence | None = None) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler running a beam search of priority 5 whose prompt step picked two beams (and
    `plain`, admitted after the first beam and before the second one forked)."""
    sched = make(max_num_seqs=max_num_seqs)
    beam = beam_request("beam", priority=5)
    sched.add_request(beam)
    extra = [plain] if plain is not None else []
    for s in extra:
        sched.add(s)
    out = sched.schedule()
    logprobs = torch.log_softmax(torch.tensor([0.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0]), dim=-1)
    result = SamplerOutput([1] + [7] * len(extra), [None] * (1 + len(extra)), [logprobs] + [None] * len(extra))
    sched.update_from_output(out, ([beam.sequences[0], *extra], result))
    assert len(beam.sequences) == 2
    return sched, beam.sequences


def test_beams_are_never_priority_victims() -> None:
    plain = seq("plain", 4, 5, first=20)
    sched, (first, second) = with_two_beams(3, plain)
    assert sched.running == [first, plain, second]
    sched.add(seq("urgent", 4, 0, first=40))
    out = sched.schedule()
    assert out.preempted == [plain]  # admitted before the second beam, but the only one not a beam
    assert first.status is second.status is SeqStatus.RUNNING
    assert [item.seq.request_id for item in out.scheduled] == ["beam", "beam", "urgent"]


def test_a_seat_held_by_beams_is_not_taken() -> None:
    sched, beams = with_two_beams(2)
    assert sched.running == beams
    sched.add(seq("urgent", 4, 0, first=40))
    out = sched.schedule()
    assert out.preempted == [] and [item.seq for item in out.scheduled] == beams
    assert sched.counters.num_preemptions == 0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_engine_serves_the_urgent_request_first_and_both_match_transformers(llama_ckpt: Path) -> None:
    engine = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, max_num_seqs=1).engine
    prompts = {"background": list(range(30, 60)), "urgent": list(range(100, 110))}
    lengths = {"background": 16, "urgent": 5}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    finished = []

    def run_step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            finished.extend([out.request_id] if out.finished else [])

    engine.add_request("background", {"prompt_token_ids": prompts["background"]},
                       greedy(lengths["background"]), priority=5)
    for _ in range(4):
        run_step()
    engine.add_request("urgent", {"prompt_token_ids": prompts["urgent"]},
                       greedy(lengths["urgent"]), priority=0)
    run_step()
    assert len(tokens["urgent"]) == 1 and len(tokens["background"]) == 4  # admitted at once, alone
    while engine.has_unfinished_requests():
        run_step()
    assert finished == ["urgent", "background"]
    stats = engine.stats()
    assert stats["num_priority_preemptions"] == stats["num_preemptions"] == 1
    names = list(prompts)
    reference = hf_greedy(llama_ckpt, tuple(tuple(prompts[n]) for n in names), tuple(lengths[n] for n in names),
                          ignore_eos=True)
    assert [tokens[n] for n in names] == reference


def test_blocks_running_short_preempt_the_least_urgent_not_the_latest_admitted() -> None:
    """A running sequence that needs a block when none is free takes it from the least urgent running
    one, even one admitted before it (a batch line beside an interactive request), never from a more
    urgent one admitted later."""
    sched = make(max_num_seqs=4, num_blocks=3)  # 3 blocks of 4 tokens
    batch, urgent = seq("batch", 4, 9), seq("urgent", 4, 0, first=20)
    running(sched, batch)
    sched.add(urgent)
    # batch decodes into its second block, urgent computes its prompt into the last one
    assert scheduled(sched) == ([], ["batch", "urgent"])
    # urgent's first decode needs a block and none is free: batch (admitted first) gives its blocks up
    assert scheduled(sched) == (["batch"], ["urgent"])
    assert sched.running == [urgent] and batch.status is SeqStatus.WAITING and sched.waiting.peek() is batch
