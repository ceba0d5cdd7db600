"""Phi-3's LongRoPE past its original context. transformers picks the short or the long factors by
the length of each forward call; the engine picks one set by `max_model_len` (streamer/layers/
rotary.py). Both agree, token for token, where that choice is the same: every sequence within the
original context when the engine serves no more, and prompts longer than it when it serves more."""

from __future__ import annotations

from pathlib import Path

import pytest
from families import phi3_spec
from parity import hf_greedy, parity_prompts

from streamer import LLM, SamplingParams
from streamer.random_checkpoint import build_checkpoint

ORIGINAL = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("phi3_longrope"), phi3_spec(ORIGINAL), seed=4)


def _greedy(ckpt: Path, prompts: list[list[int]], budgets: list[int], **kwargs: object) -> list[list[int]]:
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=96, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n) for n in budgets])
    return [o.outputs[0].token_ids for o in outs]


def test_long_factors_past_the_original_context(ckpt: Path) -> None:
    prompts = [p for p in parity_prompts(512, seed=2) if len(p) > ORIGINAL]  # 129, 200, 300 tokens
    budgets = [12] * len(prompts)
    got = _greedy(ckpt, prompts, budgets)  # max_model_len 1024: the long factors
    assert got == hf_greedy(ckpt, tuple(map(tuple, prompts)), tuple(budgets))


def test_short_factors_within_it(ckpt: Path) -> None:
    prompts = [p for p in parity_prompts(512, seed=2) if len(p) < 40]
    budgets = [ORIGINAL - len(p) for p in prompts]  # each runs to the last position of the original context
    got = _greedy(ckpt, prompts, budgets, max_model_len=ORIGINAL)
    assert got == hf_greedy(ckpt, tuple(map(tuple, prompts)), tuple(budgets))
    assert [len(g) for g in got] == budgets

