"""Reported logprobs equal transformers' scores for the same tokens.

The engine reports raw logprobs (log-softmax of the model's logits before any sampling parameter
is applied, vLLM's default): the chosen token's value and the top-k alternatives. The reference is
transformers' own forward pass on the same checkpoint: `compute_transition_scores` over
`generate`'s raw logits for greedy runs, and a teacher-forced forward over prompt + sampled tokens
for sampled runs. Both sides run float32 with different kernels and summation orders; on this tiny
model the logits differ by ~1e-6, so logprobs are compared at atol 1e-4.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from streamer import LLM, SamplingParams

PROMPTS = [[13, 200, 77, 91, 5, 300, 41], [400, 12, 12, 99]]
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(llama_ckpt: Path) -> LLM:
    return LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, seed=0)


@cache
def hf_model(ckpt: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def hf_logprobs(ckpt: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """`[len(output), V]`: log-softmax of the logits that predicted each output token."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(ckpt)(ids).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_entries_match(entries: list[dict[int, float]], tokens: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(tokens) == ref.shape[0]
    for pos, (entry, token) in enumerate(zip(entries, tokens)):
        top = ref[pos].topk(k)
        want = dict(zip(top.indices.tolist(), top.values.tolist()))
        want[token] = float(ref[pos, token])
        assert set(entry) == set(want), f"position {pos}: other tokens reported"
        for t, value in entry.items():
            assert value == pytest.approx(want[t], abs=ATOL), f"position {pos}, token {t}"


def test_greedy_logprobs_equal_compute_transition_scores(llm: LLM, llama_ckpt: Path) -> None:
    model = hf_model(llama_ckpt)
    for prompt in PROMPTS:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                                                        ignore_eos=True))[0].outputs[0]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                 eos_token_id=None)
        tokens = gen.sequences[0, len(prompt):].tolist()
        assert out.token_ids == tokens
        scores = model.compute_transition_scores(gen.sequences, gen.logits, normalize_logits=True)[0]
        chosen = [entry[t] for entry, t in zip(out.logprobs, out.token_ids)]
        assert chosen == pytest.approx(scores.tolist(), abs=ATOL)
        assert_entries_match(out.logprobs, tokens, hf_logprobs(llama_ckpt, prompt, tokens), k=3)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=5, ignore_eos=True),
    SamplingParams(temperature=1.4, top_k=20, top_p=0.9, presence_penalty=1.0, seed=8, max_tokens=10,
                   logprobs=0, ignore_eos=True),
    SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=6, logprobs=2, ignore_eos=True),
], ids=["temperature", "warped-and-penalised", "n=3"])
def test_sampled_logprobs_are_the_raw_model_distribution(llm: LLM, llama_ckpt: Path, params: SamplingParams) -> None:
    """Sampling parameters change which token is drawn, not the logprobs reported for it."""
    prompt = PROMPTS[0]
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert len(out.outputs) == params.n
    for completion in out.outputs:
        ref = hf_logprobs(llama_ckpt, prompt, completion.token_ids)
        assert_entries_match(completion.logprobs, completion.token_ids, ref, k=params.logprobs)
