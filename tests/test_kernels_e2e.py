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


def _greedy(ckpt: Path, backend: str, device: str) -> tuple[list[list[int]], dict[str, int]]:
    llm = LLM(str(ckpt), attention_backend=backend, device=device, block_size=8, num_kv_blocks=64,
              max_num_batched_tokens=16, seed=0)
    assert llm.stats()["attention_backend"] == backend
    runner_backend = llm.engine.runner.backend
    forward = runner_backend.forward
    seen = {"decode": 0, "prefill": 0, "extend": 0}

    def counting_forward(query, key_cache, value_cache, meta, scale):  # noqa: ANN001, ANN202
        seen["decode"] += meta.num_decodes
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1])[meta.num_decodes:]
        ctx = meta.seq_lens[meta.num_decodes:] - q_lens
        seen["prefill"] += int((ctx == 0).sum())
        seen["extend"] += int((ctx > 0).sum())
        return forward(query, key_cache, value_cache, meta, scale)

    runner_backend.forward = counting_forward
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], seen


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
@pytest.mark.parametrize("ckpt_fixture", ["llama_ckpt", "qwen2_ckpt"])
def test_triton_backend_generates_the_torch_backends_greedy_tokens(ckpt_fixture: str, device: str,
                                                                   request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(ckpt_fixture)
    expected, _ = _greedy(ckpt, "torch", device)
    got, seen = _greedy(ckpt, "triton", device)
    assert got == expected
    assert all(len(t) == 5 for t in got)
    assert seen["decode"] and seen["prefill"] and seen["extend"], seen  # every attention path ran
