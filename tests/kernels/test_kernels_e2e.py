"""End to end: the engine on the Triton backend (interpreted on CPU) generates what the torch one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_testing import INTERPRET

from streamer import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello",
    # Longer than max_num_batched_tokens below: prefilled in chunks, the later ones extending
    # context already in the cache.
    "Redis streams carry jobs from clients in any language to workers, and tokens flow back",
]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


def _spied_llm(ckpt: Path, backend: str, device: str, **kwargs: object) -> tuple[LLM, dict[str, int]]:
    """An LLM whose backend counts which attention paths and block copies it served."""
    llm = LLM(str(ckpt), dtype="float32", attention_backend=backend, device=device, block_size=8, num_kv_blocks=64,
              seed=0, **kwargs)
    assert llm.stats()["attention_backend"] == backend
    be = llm.engine.executor.backend
    forward, copy_blocks = be.forward, be.copy_blocks
    seen = {"decode": 0, "prefill": 0, "extend": 0, "copy_blocks": 0}

    def counting_forward(query, key_cache, value_cache, meta, scale, **options):  # noqa: ANN001, ANN003, ANN202
        seen["decode"] += meta.num_decodes
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1])[meta.num_decodes:]
        ctx = meta.seq_lens[meta.num_decodes:] - q_lens
        seen["prefill"] += int((ctx == 0).sum())
        seen["extend"] += int((ctx > 0).sum())
        return forward(query, key_cache, value_cache, meta, scale, **options)

    def counting_copy_blocks(key_caches, value_caches, mapping):  # noqa: ANN001, ANN202
        seen["copy_blocks"] += mapping.shape[0]
        return copy_blocks(key_caches, value_caches, mapping)

    be.forward, be.copy_blocks = counting_forward, counting_copy_blocks
    return llm, seen


def _greedy_batch(ckpt: Path, backend: str, device: str) -> tuple[list[list[int]], dict[str, int]]:
    llm, seen = _spied_llm(ckpt, backend, device, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ckpt_fixture", ["llama_ckpt", "qwen2_ckpt"])
def test_triton_backend_generates_the_torch_backends_greedy_tokens(ckpt_fixture: str, device: str,
                                                                   request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(ckpt_fixture)
    expected, _ = _greedy_batch(ckpt, "torch", device)
    got, seen = _greedy_batch(ckpt, "triton", device)
    assert got == expected
    assert all(len(t) == 5 for t in got)
    assert seen["decode"] and seen["prefill"] and seen["extend"], seen  # every attention path ran


def _cache_and_forks(ckpt: Path, backend: str, device: str) -> tuple[list, int, dict[str, int]]:
    llm, seen = _spied_llm(ckpt, backend, device)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = llm.generate([PROMPTS[2]], greedy)[0]
    again = llm.generate([PROMPTS[2]], greedy)[0]  # its full blocks come from the prefix cache
    forks = llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=7, ignore_eos=True))[0]
    tokens = [first.outputs[0].token_ids, again.outputs[0].token_ids, [c.token_ids for c in forks.outputs]]
    return tokens, again.num_cached_tokens, seen


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_matches_torch_with_prefix_cache_hits_and_forked_samples(device: str,
                                                                               llama_ckpt: Path) -> None:
    expected, _, _ = _cache_and_forks(llama_ckpt, "torch", device)
    got, cached, seen = _cache_and_forks(llama_ckpt, "triton", device)
    assert got == expected
    assert got[0] == got[1]
    assert cached > 0 and seen["extend"], seen  # attention over context the cache supplied
    assert seen["copy_blocks"], seen  # the two samples' shared last block was copied on write
