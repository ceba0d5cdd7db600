"""A request whose step fails is failed alone: the step runs again without it and everyone else's
tokens are exactly what they would have been (greedy, compared token for token with a clean run)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from streamer import LLM, SamplingParams
from streamer.errors import TensorParallelError
from streamer.scheduler_output import ScheduledSeq

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class PoisonedRunner:
    """The real runner, except that a step holding a row of a poisoned request raises (as a bad
    parameter deep in the sampler or a kernel would), once that row has `after` output tokens."""

    def __init__(self, runner: Any, poisoned: set[str], after: int = 0, error: type[Exception] = RuntimeError) -> None:
        self.runner, self.poisoned, self.after, self.error = runner, poisoned, after, error
        self.calls: list[int] = []  # rows per execute call

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, scheduled: list[ScheduledSeq], block_copies: Any = None) -> Any:
        self.calls.append(len(scheduled))
        for row in scheduled:
            if row.seq.request_id in self.poisoned and row.seq.num_output_tokens >= self.after:
                raise self.error(f"poisoned row of {row.seq.request_id}")
        return self.runner.execute(scheduled, block_copies)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(8, 500) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


@pytest.fixture
def llm(llama_ckpt: Path) -> LLM:
    return LLM(str(llama_ckpt), dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=16)


def run(llm: LLM, batch: list[list[int]], ids: list[str], params: list[SamplingParams]) -> dict[str, Any]:
    engine = llm.engine
    for request_id, prompt, p in zip(ids, batch, params, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, p)
    merged: dict[str, Any] = {"steps": 0}
    while engine.has_unfinished_requests():
        merged["steps"] += 1
        for out in engine.step():
            acc = merged.setdefault(out.request_id, {"tokens": {}, "reasons": {}, "error": None})
            for c in out.outputs:
                acc["tokens"].setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason is not None:
                    acc["reasons"][c.index] = c.finish_reason
            acc["error"] = out.error if out.finished else acc["error"]
    return merged


@pytest.mark.parametrize("after", [0, 5])  # fails at its prefill, or in the middle of decoding
def test_a_failing_request_is_failed_alone_and_the_rest_match_a_clean_run(llm: LLM, after: int) -> None:
    batch = prompts(7)
    ids = [f"r{i}" for i in range(7)]
    params = [GREEDY] * 7
    clean = run(llm, batch, ids, params)
    ids[3] = "poison"
    llm.engine.executor = runner = PoisonedRunner(llm.engine.executor, {"poison"}, after=after)
    got = run(llm, batch, ids, params)
    for request_id, clean_id in zip(ids, [f"r{i}" for i in range(7)], strict=True):
        if request_id == "poison":
            continue
        assert got[request_id]["tokens"] == clean[clean_id]["tokens"]
        assert got[request_id]["reasons"] == {0: "length"} and got[request_id]["error"] is None
    poison = got["poison"]
    assert poison["reasons"] == {0: "error"}
    assert "RuntimeError: poisoned row of poison" in poison["error"]
    assert len(poison["tokens"].get(0, [])) == after  # what it streamed before the failure stands
    # Bisecting 7 requests for one culprit: two runs per halving (3 halvings), not one per request.
    assert len(runner.calls) - got["steps"] <= 6 and max(runner.calls) == 7
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.executor.num_kv_blocks


def test_every_sample_of_a_failing_request_fails_and_other_samples_go_on(llm: LLM) -> None:
    batch = prompts(3)
    n3 = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8, ignore_eos=True)
    clean = run(llm, batch, ["a", "b", "c"], [GREEDY, n3, GREEDY])
    llm.engine.executor = PoisonedRunner(llm.engine.executor, {"b"}, after=2)
    got = run(llm, batch, ["a", "b", "c"], [GREEDY, n3, GREEDY])
    assert got["b"]["reasons"] == {0: "error", 1: "error", 2: "error"}
    assert got["a"]["tokens"] == clean["a"]["tokens"] and got["c"]["tokens"] == clean["c"]["tokens"]


def test_two_culprits_in_one_step_are_both_found(llm: LLM) -> None:
    batch = prompts(8)
    ids = [f"r{i}" for i in range(8)]
    clean = run(llm, batch, ids, [GREEDY] * 8)
    llm.engine.executor = PoisonedRunner(llm.engine.executor, {"r1", "r6"})
    got = run(llm, batch, ids, [GREEDY] * 8)
    assert {i for i in ids if got[i]["error"] is not None} == {"r1", "r6"}
    assert all(got[i]["tokens"] == clean[i]["tokens"] for i in ids if i not in {"r1", "r6"})


def test_a_single_failing_request_leaves_the_engine_serving(llm: LLM) -> None:
    llm.engine.executor = PoisonedRunner(llm.engine.executor, {"poison"})
    got = run(llm, prompts(1), ["poison"], [GREEDY])
    assert got["poison"]["reasons"] == {0: "error"}
    after = run(llm, prompts(1), ["next"], [GREEDY])
    assert after["next"]["reasons"] == {0: "length"} and len(after["next"]["tokens"][0]) == 12


def test_a_step_every_request_fails_is_the_engines_fault(llm: LLM) -> None:
    """Nothing to blame on a request (a broken device, an engine bug): the error stops the engine."""
    llm.engine.executor = PoisonedRunner(llm.engine.executor, {"a", "b", "c"})
    with pytest.raises(RuntimeError, match="poisoned row"):
        run(llm, prompts(3), ["a", "b", "c"], [GREEDY] * 3)


def test_engine_wide_errors_are_never_bisected(llm: LLM) -> None:
    llm.engine.executor = runner = PoisonedRunner(llm.engine.executor, {"b"}, error=TensorParallelError)
    with pytest.raises(TensorParallelError):
        run(llm, prompts(3), ["a", "b", "c"], [GREEDY] * 3)
    assert runner.calls == [3]
