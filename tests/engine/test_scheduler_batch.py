"""A Batch API batch beside interactive traffic, on the real scheduler and block manager (no model): batch
sequences (the least urgent priority) hold every seat, or prefill a long prompt in chunks, and interactive
ones arrive. Every interactive sequence that arrives is admitted at the very next step, however many
arrive at once (the batch ones it needs are preempted, the latest admitted first), a batch prompt waits
for a step that computes no interactive prompt (batch decodes go on), and the preempted batch sequences
are recomputed afterwards; end to end, every output is still transformers' greedy output, each once."""

from __future__ import annotations

from pathlib import Path

from parity import hf_greedy
from test_block_manager import step
from test_scheduler_priority import make, running, scheduled, seq

from streamer import LLM, SamplingParams
from streamer.request import SeqStatus

BATCH = 2**30  # the batch lane's priority (clients/names.py BATCH_PRIORITY); interactive jobs run at 0


def test_a_burst_of_interactive_arrivals_is_admitted_at_the_next_step_by_preempting_batch_ones() -> None:
    sched = make(max_num_seqs=4)
    batch = [seq(f"b{i}", 4, BATCH, first=10 * i + 1) for i in range(4)]
    running(sched, *batch)
    for i in range(3):
        sched.add(seq(f"i{i}", 4, 0, first=100 + 10 * i))
    assert scheduled(sched) == (["b3", "b2", "b1"], ["b0", "i0", "i1", "i2"])
    assert sched.counters.num_priority_preemptions == 3
    assert all(b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 for b in batch[1:])
    assert [s.request_id for s in sched.waiting.in_order()] == ["b1", "b2", "b3"]  # back in admission order


def test_preempted_batch_sequences_resume_once_the_interactive_ones_finish() -> None:
    sched = make(max_num_seqs=2)
    b0, b1 = seq("b0", 4, BATCH), seq("b1", 4, BATCH, first=20)
    running(sched, b0, b1)
    step(sched)  # each has two output tokens
    sched.add(seq("i0", 4, 0, first=40, max_tokens=2))
    sched.add(seq("i1", 4, 0, first=60, max_tokens=2))
    assert scheduled(sched) == (["b1", "b0"], ["i0", "i1"])
    assert b0.token_ids[4:] == b1.token_ids[4:] == [7, 7]  # what they generated is kept, to be recomputed
    assert scheduled(sched) == ([], ["i0", "i1"])  # their second and last tokens
    out, _ = step(sched)  # both back at once, recomputing prompt and output, then sampling their third
    assert [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled] == [("b0", 6), ("b1", 6)]
    assert [item.num_new_tokens for item in step(sched)[0].scheduled] == [1, 1]  # decoding again
    assert b0.num_computed_tokens == b1.num_computed_tokens == 7 and b0.num_tokens == b1.num_tokens == 8


def test_only_as_many_batch_sequences_as_the_arrivals_need_are_preempted() -> None:
    sched = make(max_num_seqs=4)
    running(sched, seq("b0", 4, BATCH), seq("b1", 4, BATCH, first=20))
    sched.add(seq("i0", 4, 0, first=40))
    assert scheduled(sched) == ([], ["b0", "b1", "i0"])
    sched.add(seq("i1", 4, 0, first=60))  # the free seat
    sched.add(seq("i2", 4, 0, first=80))  # b1's
    assert scheduled(sched) == (["b1"], ["i0", "b0", "i1", "i2"])  # running ones most urgent first


def test_a_batch_prompt_waits_for_a_step_without_an_interactive_prompt() -> None:
    sched = make(budget=16)
    long_batch = seq("batch", 100, BATCH)
    sched.add(long_batch)
    step(sched)
    assert long_batch.num_computed_tokens == 16  # a prompt computed in chunks of the whole budget
    sched.add(seq("urgent", 10, 0, first=200))
    out, _ = step(sched)  # the batch chunk neither takes the urgent prompt's budget nor the 6 tokens left
    assert [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled] == [("urgent", 10)]
    assert out.preempted == [] and long_batch.num_computed_tokens == 16
    assert [(item.seq.request_id, item.num_new_tokens) for item in step(sched)[0].scheduled] == \
        [("urgent", 1), ("batch", 15)]


def test_batch_decodes_keep_their_tokens_and_batch_admissions_wait_while_an_interactive_prompt_runs() -> None:
    sched = make(budget=16)
    decoding = seq("decoding", 4, BATCH)
    running(sched, decoding)
    sched.add(seq("urgent", 20, 0, first=200))
    sched.add(seq("next line", 4, BATCH, first=300))
    out, _ = step(sched)
    assert [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled] == [("decoding", 1), ("urgent", 15)]
    out, _ = step(sched)  # the urgent prompt's last 5 tokens: the next batch line is still not admitted
    assert [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled] == [("urgent", 5), ("decoding", 1)]
    out, _ = step(sched)
    assert [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled] == \
        [("urgent", 1), ("decoding", 1), ("next line", 4)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_engine_preempted_batch_lines_recompute_to_transformers_output_each_once(llama_ckpt: Path) -> None:
    engine = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, max_num_seqs=3).engine
    prompts = {f"line{i}": list(range(30 + 7 * i, 50 + 7 * i)) for i in range(3)}
    prompts |= {f"chat{i}": list(range(100 + 5 * i, 108 + 5 * i)) for i in range(2)}
    lengths = {name: 12 if name.startswith("line") else 4 for name in prompts}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    finished: list[str] = []

    def run_step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            finished.extend([out.request_id] if out.finished else [])

    for name in prompts:
        if name.startswith("line"):
            engine.add_request(name, {"prompt_token_ids": prompts[name]}, greedy(lengths[name]), priority=BATCH)
    for _ in range(3):
        run_step()
    for name in ("chat0", "chat1"):
        engine.add_request(name, {"prompt_token_ids": prompts[name]}, greedy(lengths[name]), priority=0)
    run_step()
    assert len(tokens["chat0"]) == len(tokens["chat1"]) == 1  # both seated at the step after they came
    while engine.has_unfinished_requests():
        run_step()
    assert finished[:2] == ["chat0", "chat1"] and sorted(finished[2:]) == ["line0", "line1", "line2"]
    assert engine.stats()["num_priority_preemptions"] == 2
    names = list(prompts)
    reference = hf_greedy(llama_ckpt, tuple(tuple(prompts[n]) for n in names), tuple(lengths[n] for n in names),
                          ignore_eos=True)
    assert [tokens[n] for n in names] == reference
