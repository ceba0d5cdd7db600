"""The compiled CPU RMSNorm, rotary and SiLU-and-mul against their torch references, on fresh
random inputs at several shapes.

Tolerance: relative error 2e-6 in float32. Both sides compute in float32; the kernels sum the
squares of a row in a different order (vectorized partial sums) and may fuse a multiply and add
(-ffast-math), each worth a few ulps (float32 ulp = 1.2e-7 relative)."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref
from kernels.cpu_extension import load
from kernels.elementwise_cpu import rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_embedding_ref
from streamer.attention.cpu_backend import CpuBackend

TOL = 2e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_kernels_build_here():
    assert load() is not None, "the C++ CPU kernels must compile on this machine (g++ and ninja are installed)"


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 768), (64, 4096), (300, 80)])
def test_rms_norm_matches_reference(tokens, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen) * 3
    w = torch.randn(hidden, generator=gen)
    assert rel(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)) < TOL


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (33, 768), (200, 2048)])
def test_fused_add_rms_norm_matches_reference_in_place(tokens, hidden):
    gen = torch.Generator().manual_seed(tokens * hidden)
    x, residual = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    ref_out, ref_sum = rms_norm_ref(x.clone(), w, 1e-6, residual.clone())
    out, new_residual = rms_norm_cpu(x, w, 1e-6, residual)
    assert out is x and new_residual is residual  # updated in place, as the model expects
    assert torch.equal(new_residual, ref_sum)  # one float32 add: exact
    assert rel(out, ref_out) < TOL


@pytest.mark.parametrize("tokens, heads, kv_heads, head_size", [(1, 4, 4, 64), (19, 12, 4, 64), (70, 8, 2, 128),
                                                              (5, 6, 6, 80)])
def test_rotary_matches_reference_on_strided_views(tokens, heads, kv_heads, head_size):
    """query and key are column slices of one fused QKV projection output, as in the model."""
    gen = torch.Generator().manual_seed(tokens + head_size)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen)
    cache = torch.randn(4096, head_size, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_ref, k_ref, _ = qkv.clone().split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    v_before = v.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size)
    rotary_embedding_cpu(positions, q, k, cache, head_size)
    assert rel(q, q_ref) < TOL and rel(k, k_ref) < TOL
    assert torch.equal(v, v_before)  # the value columns between/after are not touched


def test_rotary_refuses_a_position_outside_the_table():
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rotary_embedding_cpu(torch.tensor([0, 10]), q, k, torch.randn(10, 64), 64)


@pytest.mark.parametrize("tokens, inter", [(1, 64), (64, 2048), (129, 11008 // 4)])
def test_silu_and_mul_matches_reference(tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter)
    x = torch.randn(tokens, 2 * inter, generator=gen) * 4
    assert rel(silu_and_mul_cpu(x), silu_and_mul_ref(x)) < TOL


def test_backend_uses_the_references_for_16_bit_types():
    """bfloat16 keeps the reference's rounding points (those of Hugging Face): same bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 256, generator=gen).bfloat16()
    w = torch.randn(256, generator=gen).bfloat16()
    assert torch.equal(CpuBackend().rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    assert torch.equal(CpuBackend().silu_and_mul(x), silu_and_mul_ref(x))
