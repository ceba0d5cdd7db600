"""Grammar budgets (docs/structured_outputs.md#budgets): an ambiguous EBNF grammar whose masks take
longer with every token, and JSON schemas of 2,000 optional properties that take a minute to compile,
sent to a worker beside three plain streams, leave those streams' inter-token gaps and a plain
request's first token as they were alone (the same phases as bench/grammar_budget.py), and the hostile
requests alone fail, each with `invalid_params` naming the budget it went over."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from redis_worker_helpers import kill_all, long_context_checkpoint, running_worker, worker_process

from bench.grammar_budget import AMBIGUOUS, outcome, run_phase, wide_schema
from clients.redis_client import AsyncClient
from streamer import EngineConfig, LLMEngine, SamplingParams

# Small budgets, so the test is quick: the grammar's masks pass 50 ms of CPU within its first ~50
# tokens on the tiny model's vocabulary, a wide schema compiles for about a minute.
BUDGETS = {"grammar_mask_budget_s": 0.05, "grammar_compile_timeout_s": 1.0}
FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in BUDGETS.items()]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_context_checkpoint(tmp_path_factory.mktemp("long"))


@pytest.mark.anyio
async def test_hostile_grammars_fail_alone_and_leave_other_streams_as_they_were(ckpt: Path, redis_url: str,
                                                                               cpu_kernels: None) -> None:
    # A worker process of its own: the gaps are the worker's, not this test's GIL shared with it.
    procs = {"w": worker_process(ckpt, redis_url, "--num-kv-blocks", "1024", *FLAGS)}
    try:
        async with AsyncClient(redis_url) as client:
            with anyio.fail_after(120):
                while not await client.live_workers():
                    await anyio.sleep(0.1)
            baseline = await run_phase(client, hostile=False, baseline_s=4.0)  # long enough for a steady p99
            hostile = await run_phase(client, hostile=True)
            after = await client.generate("x", params={"max_tokens": 3, "ignore_eos": True})  # it serves on
    finally:
        kill_all(procs)
    assert after.finish_reason == "length"
    assert hostile.outcomes["grammar"].startswith("invalid_params: ") and "grammar_mask_budget_s" in \
        hostile.outcomes["grammar"], hostile.outcomes
    for k in range(3):
        outcome = hostile.outcomes[f"schema {k}"]
        assert outcome.startswith("invalid_params: ") and "grammar_compile_timeout_s" in outcome, outcome
    summary = (f"median {baseline.median * 1e3:.1f} -> {hostile.median * 1e3:.1f} ms, p99 {baseline.p99 * 1e3:.1f} "
               f"-> {hostile.p99 * 1e3:.1f} ms, first token {baseline.first_token_s * 1e3:.0f} -> "
               f"{hostile.first_token_s * 1e3:.0f} ms")
    assert len(baseline.gaps) > 100 and len(hostile.gaps) > 100, summary
    assert hostile.median <= 1.5 * baseline.median, summary
    assert hostile.p99 <= 3 * baseline.p99, summary
    assert hostile.first_token_s <= 3 * baseline.first_token_s + 0.2, summary


@pytest.mark.parametrize("budgets, named", [({"grammar_mask_budget_s": 0.02}, "grammar_mask_budget_s"),
                                            ({"grammar_mask_budget_s": 10.0, "grammar_request_budget_s": 0.1},
                                             "grammar_request_budget_s")])
def test_a_request_over_a_grammar_budget_fails_alone_with_the_budget_named(ckpt: Path, budgets: dict,
                                                                           named: str) -> None:
    """The offline engine too: the request over the budget ends with an error saying which budget, a
    plain request beside it runs to its end."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=256, **budgets))
    try:
        hostile = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=300, min_tokens=290,
                                 structured_outputs={"grammar": AMBIGUOUS})
        engine.add_request("hostile", "words", hostile)
        engine.add_request("plain", "x", SamplingParams(max_tokens=400, ignore_eos=True))
        last = {}
        tokens = {"hostile": 0, "plain": 0}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += sum(len(c.token_ids) for c in out.outputs)
                last[out.request_id] = out
        assert last["hostile"].error_code == "invalid_params" and named in last["hostile"].error, last["hostile"]
        assert tokens["hostile"] < 4 * 300
        assert last["plain"].error is None and tokens["plain"] == 400
    finally:
        engine.shutdown()


@pytest.mark.anyio
async def test_a_compile_over_its_limit_is_refused_and_a_plain_request_is_not_held_behind_it(
        ckpt: Path, redis_url: str) -> None:
    async with running_worker(ckpt, redis_url, engine=BUDGETS), AsyncClient(redis_url) as client:
        slow = await client.submit("json", params={"structured_outputs": {"json": wide_schema()}})
        plain = await client.generate("x", params={"max_tokens": 2, "ignore_eos": True}, timeout=5)
        assert plain.finish_reason == "length"
        refused = await outcome(client, slow)
    assert refused.startswith("invalid_params: ") and "grammar_compile_timeout_s" in refused, refused


def test_samples_forked_after_the_prompt_wait_for_their_first_masks(ckpt: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples 1..n-1 draw their first token from sample 0's last prompt row: that row waits until their
    masks are filled too (a slow mask thread here), and every sample stays inside the grammar."""
    from streamer.grammar import GrammarState

    fill = GrammarState.fill

    def slow_fill(state: GrammarState) -> None:
        time.sleep(0.05)
        fill(state)

    monkeypatch.setattr(GrammarState, "fill", slow_fill)
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=256))
    try:
        engine.add_request("forked", "x", SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=8,
                                                         structured_outputs={"choice": ["yes", "no way"]}))
        texts = ["", "", "", ""]
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                for c in out.outputs:
                    texts[c.index] += c.text
        assert all(text in ("yes", "no way") for text in texts), texts
    finally:
        engine.shutdown()
