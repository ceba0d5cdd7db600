"""Each model family of tests/families.py against transformers' greedy generate, token for token
(float32), on the engine's paths: mixed prefill/decode steps with chunked prompts, the pure-torch
reference backend under preemption, the Triton kernels under the interpreter, tensor parallelism;
log-probs as test_logprobs compares them; bfloat16's drift from float32 as test_engine_parity
measures it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from families import FAMILIES
from kernel_testing import INTERPRET
from parity import hf_greedy, parity_prompts
from test_engine_parity import reference, run_engine
from test_logprobs import assert_entries_match, hf_logprobs
from test_tensor_parallel import MAX_TOKENS as TP_MAX_TOKENS
from test_tensor_parallel import PROMPT_LENGTHS, two_rounds

from streamer import LLM, SamplingParams
from streamer.random_checkpoint import build_checkpoint


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp(request.param), FAMILIES[request.param], seed=3)


def test_greedy_parity_mixed_chunked_batches(ckpt: Path) -> None:
    prompts = parity_prompts(512)
    got, stats = run_engine(ckpt, prompts, block_size=16, max_num_batched_tokens=160, num_kv_blocks=512)
    assert got == reference(ckpt, prompts)
    assert stats["num_mixed_steps"] > 0 and stats["num_partial_prefills"] > 0


def test_reference_backend_under_preemption(ckpt: Path) -> None:
    prompts = parity_prompts(512)
    got, stats = run_engine(ckpt, prompts, attention_backend="torch", block_size=8, num_kv_blocks=96,
                            max_num_batched_tokens=512)
    assert stats["num_preemptions"] > 0
    assert got == reference(ckpt, prompts)


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
def test_triton_kernels_under_the_interpreter(ckpt: Path) -> None:
    # 3, 17 and 40 tokens in chunks of 16 (prefill, then extends over cached context) and a few
    # decodes each: the interpreter runs every program one after another, so the batch stays small.
    prompts, budgets = parity_prompts(512, seed=4)[1:4], (4, 3, 4)
    llm = LLM(str(ckpt), dtype="float32", attention_backend="triton", device="cpu", block_size=8,
              num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n) for n in budgets])
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, tuple(map(tuple, prompts)), budgets)


def test_tensor_parallel_matches_one_device_and_transformers(ckpt: Path) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(8, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    kwargs = dict(num_kv_blocks=12, max_num_batched_tokens=128)
    got, second, stats, cached = two_rounds(ckpt, 2, prompts, **kwargs)
    one, _, _, _ = two_rounds(ckpt, 1, prompts, **kwargs)
    assert got == one
    assert stats["num_preemptions"] > 0 and cached > 0
    budgets = TP_MAX_TOKENS + [6] * len(second)
    assert [s[0] for s in got] == hf_greedy(ckpt, tuple(map(tuple, prompts + second)), tuple(budgets))


def test_logprobs_equal_transformers(ckpt: Path) -> None:
    """The chosen token's and the top 3 log-probs (raw: after Gemma 2's final soft-cap) at
    test_logprobs' tolerance, on a prompt longer than Gemma's window."""
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=64)
    for prompt in parity_prompts(512, seed=13)[2:4]:  # 17 and 40 tokens
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0].outputs[0]
        assert_entries_match(out.logprobs, out.token_ids, hf_logprobs(ckpt, prompt, out.token_ids), k=3)


def test_bfloat16_first_tokens_mostly_agree_with_float32(ckpt: Path) -> None:
    prompts = parity_prompts(512, seed=11)
    ref, _ = run_engine(ckpt, prompts, num_kv_blocks=256)
    llm = LLM(str(ckpt), dtype="bfloat16", num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4))
    agree = sum(o.outputs[0].token_ids[0] == r[0] for o, r in zip(outs, ref))
    assert agree >= 6, agree
