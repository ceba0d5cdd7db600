"""The compiled CPU RMSNorm, rotary and SiLU-and-mul against their torch references, on fresh
random inputs at several shapes.

Tolerance: relative error 2e-6 in float32. Both sides compute in float32; the kernels sum the
squares of a row in a different order (vectorized partial sums) and may fuse a multiply and add
(-ffast-math), each worth a few ulps (float32 ulp = 1.2e-7 relative). bfloat16: see
`assert_bf16_close`."""

from __future__ import annotations

import pytest
import torch
from streamer_kernels.activation import silu_and_mul_ref
from streamer_kernels.cache_ops import reshape_and_cache_ref
from streamer_kernels.cpu_extension import load
from streamer_kernels.elementwise_cpu import reshape_and_cache_cpu, rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu
from streamer_kernels.rms_norm import rms_norm_ref
from streamer_kernels.rotary import rotary_embedding_ref

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


def bf16_ulps(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements that differ, largest difference in units of the reference's last place)."""
    assert out.dtype == ref.dtype == torch.bfloat16
    o, r = out.float(), ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))) - 7)
    return (out != ref).float().mean().item(), ((o - r).abs() / ulp).max().item()


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, max_ulps: float = 1.0) -> None:
    """bfloat16 kernels round where the references round, so almost every element is bit-equal.
    The exceptions are float32 values within a few ulps of a bfloat16 rounding boundary, moved
    across it by another summation order (RMSNorm) or another exp (SiLU): measured 0-0.15% of
    elements, one bfloat16 ulp each, two where a second op rounds again (RMSNorm's weight, SiLU's up). A
    missed rounding point would differ in most elements."""
    differ, worst = bf16_ulps(out, ref)
    assert differ < 0.005 and worst <= max_ulps, (differ, worst)


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 768), (64, 4096), (300, 80)])
def test_bfloat16_rms_norm_rounds_as_the_reference(tokens, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden + 1)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).bfloat16()
    w = torch.randn(hidden, generator=gen).bfloat16()
    assert_bf16_close(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), max_ulps=2)
    residual = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ref_out, ref_sum = rms_norm_ref(x.clone(), w, 1e-6, residual.clone())
    out, new_residual = rms_norm_cpu(x, w, 1e-6, residual)
    assert torch.equal(new_residual, ref_sum)  # one add, rounded once: exact
    assert_bf16_close(out, ref_out, max_ulps=2)


@pytest.mark.parametrize("tokens, heads, kv_heads, head_size", [(1, 4, 4, 64), (19, 12, 4, 64), (70, 8, 2, 128)])
def test_bfloat16_rotary_rounds_as_the_reference(tokens, heads, kv_heads, head_size):
    gen = torch.Generator().manual_seed(tokens * head_size)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).bfloat16()
    cache = torch.randn(4096, head_size, generator=gen)  # float32, as the model keeps it
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    sizes = [heads * head_size, kv_heads * head_size, kv_heads * head_size]
    q_ref, k_ref, _ = qkv.clone().split(sizes, -1)
    q, k, _ = qkv.split(sizes, -1)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size)
    rotary_embedding_cpu(positions, q, k, cache, head_size)
    assert_bf16_close(q, q_ref)
    assert_bf16_close(k, k_ref)


@pytest.mark.parametrize("tokens, inter", [(1, 64), (64, 2048), (129, 11008 // 4)])
def test_bfloat16_silu_and_mul_rounds_as_the_reference(tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter + 2)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).bfloat16()
    assert_bf16_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), max_ulps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_at_the_extremes_and_past_the_last_whole_vector(dtype):
    """Gates where e^-g overflows or vanishes (|g| up to 500; SiLU down to ~1e-37 near g = -88.5,
    where a reciprocal of 1 + e^-g would be subnormal), and a width that leaves a tail past the
    last whole vector (100 = 6 x 16 + 4): the vector body and the scalar tail must agree with the
    reference, finite everywhere."""
    gen = torch.Generator().manual_seed(7)
    gate = torch.randn(9, 100, generator=gen) * 4
    gate[:, ::7] = torch.tensor([-500.0, -120.0, -88.5, -87.0, 0.0, 87.0, 88.5, 120.0, 500.0]).repeat(2)[:15]
    gate[:, 96:] = torch.tensor([-500.0, -88.5, -84.0, 120.0])  # the tail too
    x = torch.cat([gate, torch.randn(9, 100, generator=gen)], dim=1).to(dtype)
    out, ref = silu_and_mul_cpu(x), silu_and_mul_ref(x)
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-30)
    else:
        assert_bf16_close(out, ref, max_ulps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, kv_heads, head_size, block_size",
                         [(1, 4, 64, 16), (37, 2, 128, 32), (300, 8, 64, 16)])
def test_cache_write_matches_reference_from_the_qkv_split(dtype, tokens, kv_heads, head_size, block_size):
    """Keys and values are views of the fused QKV output (strided rows); the kernel copies them
    into their slots bit for bit and touches no other slot."""
    gen = torch.Generator().manual_seed(tokens + block_size)
    heads, num_blocks = 2 * kv_heads, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    _, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    k, v = k.view(tokens, kv_heads, head_size), v.view(tokens, kv_heads, head_size)
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    reshape_and_cache_ref(k, v, *expected, slots)
    reshape_and_cache_cpu(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_cache_write_refuses_a_slot_outside_the_cache():
    k = torch.randn(2, 2, 64)
    caches = [torch.zeros(4, 16, 2, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside the cache"):
        reshape_and_cache_cpu(k, k, *caches, torch.tensor([3, 64]))
    assert not caches[0].any()  # checked before anything is written


def test_backend_runs_the_kernels_for_bfloat16():
    """The model's bfloat16 path reaches the compiled kernels, not the references' ATen ops."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 256, generator=gen).bfloat16()
    w = torch.randn(256, generator=gen).bfloat16()
    with torch.profiler.profile() as prof:
        CpuBackend().rms_norm(x, w, 1e-5)
        CpuBackend().silu_and_mul(x)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::pow", "aten::rsqrt", "aten::silu", "aten::mul"}, sorted(names)
