"""Triton cache ops, RMSNorm, rotary and SiLU-mul against their torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICES, DTYPES, ELEMENTWISE_TOL, POISON, randn, rel_err
from streamer_kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from streamer_kernels.activation_triton import gelu_tanh_and_mul, silu_and_mul
from streamer_kernels.cache_ops import copy_blocks_ref, reshape_and_cache_ref
from streamer_kernels.cache_ops_triton import copy_blocks, reshape_and_cache
from streamer_kernels.rms_norm import rms_norm_ref
from streamer_kernels.rms_norm_triton import rms_norm
from streamer_kernels.rotary import rotary_embedding_ref
from streamer_kernels.rotary_triton import rotary_embedding


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "kv_heads", "head_size", "block_size"), [(7, 2, 80, 8), (20, 1, 64, 16)])
def test_reshape_and_cache_matches_reference(num_tokens: int, kv_heads: int, head_size: int, block_size: int,
                                             dtype: torch.dtype, device: str) -> None:
    gen = _gen(num_tokens)
    num_blocks = 6
    key_cache = randn(num_blocks, block_size, kv_heads, head_size, dtype=dtype, device=device, gen=gen)
    value_cache = randn(num_blocks, block_size, kv_heads, head_size, dtype=dtype, device=device, gen=gen)
    # K and V as the model passes them: strided views into one fused projection output.
    kv = randn(num_tokens, 3 * kv_heads * head_size, dtype=dtype, device=device, gen=gen)
    key = kv[:, :kv_heads * head_size].view(num_tokens, kv_heads, head_size)
    value = kv[:, 2 * kv_heads * head_size:].view(num_tokens, kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)  # a copy: exact


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_skips_negative_slots(device: str) -> None:
    gen = _gen(0)
    key_cache = randn(2, 8, 2, 64, dtype=torch.float16, device=device, gen=gen)
    value_cache = randn(2, 8, 2, 64, dtype=torch.float16, device=device, gen=gen)
    key = randn(3, 2, 64, dtype=torch.float16, device=device, gen=gen)
    value = randn(3, 2, 64, dtype=torch.float16, device=device, gen=gen)
    slots = torch.tensor([5, -1, 12], device=device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    reshape_and_cache_ref(key[keep], value[keep], ref_k, ref_v, slots[keep])
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype: torch.dtype, device: str) -> None:
    gen = _gen(1)
    shape = (9, 8, 2, 80)
    caches = [randn(*shape, dtype=dtype, device=device, gen=gen) for _ in range(4)]
    mapping = torch.tensor([[1, 5], [3, 7], [0, 8]], device=device)
    ref = [c.clone() for c in caches]
    copy_blocks_ref(ref[:2], ref[2:], mapping)
    copy_blocks(caches[:2], caches[2:], mapping)
    assert all(torch.equal(c, r) for c, r in zip(caches, ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "with_residual"), [((5, 96), True), ((2, 3, 200), True), ((4, 64), False)])
def test_rms_norm_matches_reference(shape: tuple, with_residual: bool, dtype: torch.dtype, device: str) -> None:
    gen = _gen(shape[-1])
    x = randn(*shape, dtype=dtype, device=device, gen=gen)
    weight = randn(shape[-1], dtype=dtype, device=device, gen=gen)
    residual = randn(*shape, dtype=dtype, device=device, gen=gen) if with_residual else None
    inputs = [t.clone() for t in (x, weight, residual) if t is not None]
    out = torch.full_like(x, POISON)
    residual_out = torch.full_like(x, POISON) if with_residual else None
    got = rms_norm(x, weight, 1e-5, residual, out=out, residual_out=residual_out)
    ref = rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        assert got[0] is out and got[1] is residual_out
        assert rel_err(residual_out, ref[1]) < ELEMENTWISE_TOL[dtype]
        ref = ref[0]
    assert rel_err(out, ref) < ELEMENTWISE_TOL[dtype]
    assert all(torch.equal(a, b) for a, b in zip(inputs, [t for t in (x, weight, residual) if t is not None]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(4, 4, 64), (8, 2, 80), (8, 1, 128)])
def test_rotary_matches_reference(heads: int, kv_heads: int, head_size: int, dtype: torch.dtype,
                                  device: str) -> None:
    gen = _gen(head_size)
    num_tokens, max_pos = 7, 50
    # A cos/sin table as the model builds it: the reference defines the layout, not the values.
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    positions = torch.randint(1, max_pos, (num_tokens,), generator=gen).to(device)  # 0 would be the identity
    # q and k as strided views of a fused qkv output; v must come out untouched.
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype, device=device, gen=gen)
    q_size, k_size = heads * head_size, kv_heads * head_size
    ref_qkv = qkv.clone()
    rotary_embedding_ref(positions, ref_qkv[:, :q_size], ref_qkv[:, q_size:q_size + k_size], cos_sin, head_size)
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + k_size]
    got_q, got_k = rotary_embedding(positions, q, k, cos_sin, head_size)
    assert got_q is q and got_k is k
    assert rel_err(qkv[:, :q_size], ref_qkv[:, :q_size]) < ELEMENTWISE_TOL[dtype]
    assert rel_err(qkv[:, q_size:q_size + k_size], ref_qkv[:, q_size:q_size + k_size]) < ELEMENTWISE_TOL[dtype]
    assert torch.equal(qkv[:, q_size + k_size:], ref_qkv[:, q_size + k_size:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 88), (2, 3, 2 * 1100)])
@pytest.mark.parametrize(("kernel", "ref"), [(silu_and_mul, silu_and_mul_ref),
                                             (gelu_tanh_and_mul, gelu_tanh_and_mul_ref)])  # Llama's, Gemma's
def test_gated_activations_match_reference(kernel, ref, shape: tuple, dtype: torch.dtype,  # noqa: ANN001
                                           device: str) -> None:
    x = randn(*shape, dtype=dtype, device=device, gen=_gen(shape[-1]))
    out = torch.full((*shape[:-1], shape[-1] // 2), POISON, dtype=dtype, device=device)
    assert kernel(x, out=out) is out
    assert rel_err(out, ref(x)) < ELEMENTWISE_TOL[dtype]
