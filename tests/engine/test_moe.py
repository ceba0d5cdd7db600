"""Mixture-of-experts layers (Qwen3-MoE, Mixtral): the grouped product against its per-expert
definition, the experts against a token-by-token sum of each token's experts, and the engine's
router against transformers' on every token of a prompt (every expert receiving some)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import FAMILIES
from kernel_testing import rel_err
from parity import parity_prompts
from streamer_kernels.grouped_gemm import grouped_mm, grouped_mm_ref

from streamer import LLM, SamplingParams
from streamer.attention.torch_backend import TorchBackend
from streamer.layers.cpu_gemm import pack_model
from streamer.layers.moe import Experts
from streamer.random_checkpoint import build_checkpoint

MOE_FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
# One to three experts: the compiled kernel splits each expert's columns across the threads too.
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 1, 0], [40, 1, 0, 17, 9, 0, 0, 33], [7], [5, 0, 9]])
def test_grouped_mm_matches_the_product_per_expert(counts: list[int], dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(sum(counts))
    a = torch.randn(sum(counts), 48, generator=gen).to(dtype)
    w = torch.randn(len(counts), 80, 48, generator=gen).to(dtype)  # stored [E, out, in] as the experts are
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    ref = grouped_mm_ref(a.float(), w.float().transpose(1, 2), offs)
    assert rel_err(grouped_mm(a, w.transpose(1, 2), offs), ref) < tol
    assert rel_err(grouped_mm(a, w.transpose(1, 2).contiguous(), offs), ref) < tol
    with torch.inference_mode():  # as the engine calls it (its threads must see the mode too)
        assert rel_err(grouped_mm(a, w.transpose(1, 2), offs), ref) < tol
    assert rel_err(grouped_mm_ref(a, w.transpose(1, 2), offs), ref) < tol


@pytest.mark.parametrize("packed", [False, True], ids=["stacked", "packed"])
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (37, 2), (64, 3)])
def test_experts_sum_each_tokens_experts(tokens: int, top_k: int, packed: bool) -> None:
    """The grouped computation against its definition, token by token: sum over the token's
    choices of weight * down(silu(gate(x)) * up(x)); packed: as the model runner leaves the
    layer on the CPU (pack_model: the compiled fused kernel over packed weights, the stacked
    copies dropped)."""
    gen = torch.Generator().manual_seed(tokens)
    num_experts, hidden, inter = 6, 32, 24
    experts = Experts(num_experts, hidden, inter, TorchBackend())
    with torch.no_grad():
        experts.w13.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2)
        experts.w2.copy_(torch.randn(num_experts, hidden, inter, generator=gen) * 0.2)
    w13, w2 = experts.w13.detach().clone(), experts.w2.detach().clone()
    if packed:
        assert pack_model(experts, batch_hint=64) == 1 and experts.packed_experts is not None
        assert experts.w13.numel() == 0 and experts.w2.numel() == 0
    x = torch.randn(tokens, hidden, generator=gen)
    chosen = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(chosen[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    with torch.inference_mode():
        assert rel_err(experts(x, weights, chosen), want) < 1e-6


def _transformers_routes(ckpt: Path, prompt: list[int]) -> list[torch.Tensor]:
    """Each MoE layer's top-k expert ids for every token of `prompt`, from transformers' router."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    routes: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: routes.append(out[2]))
    with torch.no_grad():
        model(torch.tensor([prompt]))
    return routes


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_picks_transformers_experts_for_every_token(family: str, tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path / family, FAMILIES[family], seed=8)
    prompt = parity_prompts(512, seed=8)[-1]  # 300 tokens, prefilled in one step
    llm = LLM(str(ckpt), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=512)
    ours: list[torch.Tensor] = []
    for layer in llm.engine.executor.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: ours.append(out[1].clone()))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    theirs = _transformers_routes(ckpt, prompt)
    *full, last = ours[:len(theirs)]
    # Every layer but the last routes every prompt token; the last computes the sampled row only.
    assert [r.shape[0] for r in full] == [len(prompt)] * len(full) and last.shape[0] == 1
    for got, want in zip(full, theirs):
        assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
    assert torch.equal(last.sort(dim=-1).values, theirs[-1][-1:].sort(dim=-1).values)
    num_experts = llm.engine.executor.model.layers[0].mlp.experts.num_experts
    assert all(set(r.flatten().tolist()) == set(range(num_experts)) for r in full)  # every expert got tokens
