"""The compiled experts of a mixture-of-experts layer (csrc/grouped_gemm_cpu.cpp, through
kernels/grouped_gemm.py: moe_experts and moe_layer over pack_experts' layout) against their
definitions, `moe_experts_ref` and `moe_layer_ref`, on fresh random inputs: 1 to 16 experts, top 1
to 3, 1 to 512 tokens, experts with no tokens, hidden and intermediate sizes with and without whole
packed blocks (padding), routing weights in float32 (Mixtral) and in the hidden dtype (Qwen3-MoE).

Tolerance: relative error (norm of the difference over the norm) against the definition in
float64 on the same inputs. float32: 1e-5. Both the kernel and torch's float32 products sum up to
512 products in float32 in their own orders: a few ulps (1.2e-7) times the ~sqrt(K) growth of a
sum's rounding error, in each of the two products and the activation between them (~1e-6 seen);
a wrong block, row or expert is an error of order 1. bfloat16: 1e-2. Gate, up, SiLU, h and y are
each rounded to bfloat16 (2^-9 relative) as the unfused path rounds them, and a float32 sum landing
on the other side of a rounding boundary moves a value by one ulp: ~4e-3 seen, for the kernel and
for torch's own bfloat16 computation alike, which the test holds to the same bound. The layer's
weighted sum is held to more: bit for bit the unfused path's (`index_add_` in the dtype) applied
to the kernel's own expert rows."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import rel_err
from streamer_kernels.cpu_extension import load
from streamer_kernels.grouped_gemm import (
    moe_experts,
    moe_experts_packable,
    moe_experts_ref,
    moe_layer,
    moe_layer_ref,
    pack_experts,
    sort_by_expert,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _routes(gen: torch.Generator, tokens: int, top_k: int, experts: int,
            used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, offs) as streamer/layers/moe.py builds them from each token's top_k of the first
    `used` experts (the experts past `used` get no tokens)."""
    flat = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
    rows = torch.argsort(flat, stable=True) // top_k
    return rows, torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)


def _case(experts: int, used: int, top_k: int, tokens: int, hidden: int, inter: int, dtype: torch.dtype,
          seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    rows, offs = _routes(gen, tokens, top_k, experts, used)
    return x, rows, offs, w13, w2


# (experts, experts given tokens, top_k, tokens, hidden, intermediate)
SHAPES = [
    (8, 8, 2, 1, 64, 32),      # one decode token: two experts busy, six idle
    (8, 5, 2, 64, 64, 128),    # three experts without tokens; whole blocks
    (4, 4, 1, 7, 48, 24),      # hidden and intermediate both padded (48 -> 64, 24 -> 32)
    (6, 6, 3, 37, 96, 80),     # 96 = 1.5 down blocks, 80 = 2.5 gate/up blocks
    (1, 1, 1, 5, 64, 64),      # one expert
    (8, 8, 2, 512, 256, 192),  # a prefill: several 32-row blocks per expert
    (16, 3, 3, 100, 128, 64),  # most experts idle, 100 rows each for three
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_moe_experts_match_their_definition(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert load() is not None, "the C++ CPU kernels must compile on this machine (g++ and ninja are installed)"
    if not moe_experts_packable(dtype, torch.device("cpu")):
        pytest.skip(f"this CPU or torch runs no {dtype} micro-kernels")
    experts, used, top_k, tokens, hidden, inter = shape
    x, rows, offs, w13, w2 = _case(experts, used, top_k, tokens, hidden, inter, dtype, seed=sum(shape))
    want = moe_experts_ref(x[rows].double(), offs, w13.double(), w2.double())
    packed = pack_experts(w13, w2)
    got = moe_experts(x, rows, offs, packed)
    assert got.dtype == dtype and got.shape == (tokens * top_k, hidden)
    assert rel_err(got, want) < TOL[dtype]
    assert rel_err(moe_experts_ref(x[rows], offs, w13, w2), want) < TOL[dtype]  # the bound torch meets too
    with torch.inference_mode():  # as the engine calls it
        assert torch.equal(moe_experts(x, rows, offs, packed), got)  # and the same on every call


def test_moe_experts_rows_of_idle_experts_are_not_read() -> None:
    """An expert with no rows reads none: its packed weights may hold anything (NaN here)."""
    if not moe_experts_packable(torch.float32, torch.device("cpu")):
        pytest.skip("no compiled CPU kernels")
    x, rows, offs, w13, w2 = _case(4, 2, 1, 9, 64, 32, torch.float32, seed=5)
    w13[2:], w2[2:] = float("nan"), float("nan")
    got = moe_experts(x, rows, offs, pack_experts(w13, w2))
    assert rel_err(got, moe_experts_ref(x[rows].double(), offs, w13.double(), w2.double())) < TOL[torch.float32]


@pytest.mark.parametrize("weights_dtype", ["float32", "hidden"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_moe_layer_sums_weighted_experts_as_the_unfused_path(shape: tuple[int, ...], dtype: torch.dtype,
                                                             weights_dtype: str) -> None:
    if not moe_experts_packable(dtype, torch.device("cpu")):
        pytest.skip(f"this CPU or torch runs no {dtype} micro-kernels")
    experts, used, top_k, tokens, hidden, inter = shape
    x, _, _, w13, w2 = _case(experts, used, top_k, tokens, hidden, inter, dtype, seed=sum(shape) + 1)
    gen = torch.Generator().manual_seed(len(shape))
    chosen = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    if weights_dtype == "hidden":  # Qwen3-MoE rounds them to the hidden dtype, Mixtral does not
        weights = weights.to(dtype)
    packed = pack_experts(w13, w2)
    with torch.inference_mode():
        got = moe_layer(x, weights, chosen, packed)
        order, rows, offs = sort_by_expert(chosen, experts)
        y = (moe_experts(x, rows, offs, packed) * weights.flatten()[order, None]).to(dtype)
        assert torch.equal(got, torch.zeros_like(x).index_add_(0, rows, y))
    want = moe_layer_ref(x.double(), weights.double(), chosen, w13.double(), w2.double())
    assert rel_err(got, want) < TOL[dtype]
