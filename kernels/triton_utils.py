"""Helpers shared by the Triton kernels (imports triton: only the *_triton modules import this)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand type for `tl.dot` on tensors stored as `dtype`.

    16-bit types use their native tensor-core path on the GPU. The interpreter cannot do
    arithmetic on bfloat16 (it stores it as raw integers), so there it computes in float32.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: expected float16, bfloat16 or float32")
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


def attention_num_warps(dtype: torch.dtype) -> int:
    """float32 tiles take twice the registers and its IEEE dot runs on FMAs: spread over 8 warps
    (at 4, the sm_90 build of the float32 kernels spills)."""
    return 8 if dtype == torch.float32 else 4


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs ask for IEEE products: the GPU would otherwise round them to TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          num_heads: int, num_kv_heads: int) -> None:
    """The layouts the decode and prefill attention kernels rely on."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("caches must share a layout and, like the query, have head_size contiguous")
    fp8 = key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn  # read with k_scale / v_scale
    if not fp8 and not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(f"query {query.dtype} and caches {key_cache.dtype}/{value_cache.dtype} differ")


@triton.jit
def round_to_e4m3(x):
    """float32 `x` (already within +-448) rounded to the nearest e4m3 value, nearest even, still in
    float32, so the cast to fp8 that follows is exact. The interpreter's own cast rounds a mantissa
    that carries into the exponent down by a whole binade (measured: 1 value in ~40 off by 2x);
    rounding first makes it and the GPU agree with torch. Normal values keep 3 mantissa bits;
    below 2^-6 (subnormal) values are multiples of 2^-9, rounded with the 1.5 * 2^23 trick."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    sub = ((ax * 512.0 + 12582912.0) - 12582912.0) / 512.0
    sub = tl.where(x < 0, -sub, sub)  # on the magnitude, then signed: a negative value that rounds to 0 is -0 in torch
    return tl.where(ax < 0.015625, sub, normal)


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """Cast `x` to `dtype` rounding to nearest even, as torch does.

    For bfloat16 the rounding is done on the bits: the interpreter truncates float32 ->
    bfloat16 casts, which would leave the CPU tests one ulp off the GPU. The low bits are
    cleared first, so the final cast is exact on both.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def paged_attention_step(q, m, denom, acc, kc_ptr, vc_ptr, bt_row_ptr, pos, pmask, allowed, kvh, d, dmask,
                         c_stride_b, c_stride_s, c_stride_h, block_size, scale_log2, softcap, k_scale, v_scale,
                         DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                         KV_FP8: tl.constexpr):
    """One online-softmax step of paged attention over cache positions `pos` (`pmask`: in range).

    `q` [M, D] holds query rows that all read KV head `kvh`; `allowed` [M, N] is the attention
    mask. Returns the updated running max `m` and `denom` (base 2) and accumulator `acc`. A row
    with no allowed position yet (a sliding window's first steps) keeps a max of -inf and adds
    nothing. With SOFTCAP, each natural-units score s becomes softcap * tanh(s / softcap). With
    KV_FP8 the cache holds e4m3 values, read as `value * k_scale` / `value * v_scale` in float32.
    """
    blk = tl.load(bt_row_ptr + pos // block_size, mask=pmask, other=0).to(tl.int64)
    row = blk * c_stride_b + (pos % block_size) * c_stride_s + kvh * c_stride_h
    kv_mask = pmask[:, None] & dmask[None, :]
    k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    k = k.to(DOT_DTYPE)
    v = v.to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (e^(2x) + 1), spelled with exp2 (the interpreter has no tanh); the
        # scores are in base 2 here: back to natural units, capped, and to base 2 again.
        x = s / (softcap * 1.4426950408889634)
        s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp2(x * 2.0 * 1.4426950408889634) + 1.0))
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: weights 0, not NaN
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return m_new, denom, acc
