"""Triton rotary embedding, in place on q and k; defined by `streamer_kernels.rotary.rotary_embedding_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from streamer_kernels.triton_utils import cast_rtne, next_pow2


@triton.jit
def _rotate_heads(ptr, row_stride, tok, num_heads, cos, sin, HEAD_SIZE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    half: tl.constexpr = HEAD_SIZE // 2
    heads = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (j < half)
    base = ptr + tok * row_stride + heads * HEAD_SIZE + j
    dtype = ptr.dtype.element_ty
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    # Each product and the sum are rounded to the storage dtype, exactly like the reference's
    # elementwise torch ops, so 16-bit results match it bit for bit.
    a1 = cast_rtne(x1 * cos, dtype).to(tl.float32)
    b1 = cast_rtne(x2 * sin, dtype).to(tl.float32)
    a2 = cast_rtne(x2 * cos, dtype).to(tl.float32)
    b2 = cast_rtne(x1 * sin, dtype).to(tl.float32)
    tl.store(base, cast_rtne(a1 - b1, dtype), mask=mask)
    tl.store(base + half, cast_rtne(a2 + b2, dtype), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, q_stride, k_stride, cache_stride,
                   num_q_heads, num_k_heads, HEAD_SIZE: tl.constexpr, BLOCK_QH: tl.constexpr,
                   BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per token rotates all its query and key heads with one cos/sin row.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    half: tl.constexpr = HEAD_SIZE // 2
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    cos = tl.load(cache_ptr + pos * cache_stride + j, mask=jm, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + half + j, mask=jm, other=0.0)
    # The reference casts cos/sin to the activations' dtype first.
    qcos = cast_rtne(cos.to(tl.float32), q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    qsin = cast_rtne(sin.to(tl.float32), q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    kcos = cast_rtne(cos.to(tl.float32), k_ptr.dtype.element_ty).to(tl.float32)[None, :]
    ksin = cast_rtne(sin.to(tl.float32), k_ptr.dtype.element_ty).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_stride, tok, num_q_heads, qcos, qsin, HEAD_SIZE, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, k_stride, tok, num_k_heads, kcos, ksin, HEAD_SIZE, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rotary_embedding_ref`: rotates `query` `[T, H*D]`, `key` `[T, KVH*D]` in place.

    Rows may be strided (views into a fused qkv projection); heads within a row must be packed.
    """
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 2 or t.stride(-1) != 1 or t.shape[-1] % head_size:
            raise ValueError(f"{name} must be [tokens, heads * {head_size}] with a unit last stride")
    if head_size % 2:
        raise ValueError(f"head_size must be even, got {head_size}")
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return query, key
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    num_q_heads, num_k_heads = query.shape[1] // head_size, key.shape[1] // head_size
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cache, query.stride(0), key.stride(0), cache.stride(0),
        num_q_heads, num_k_heads, HEAD_SIZE=head_size, BLOCK_QH=next_pow2(num_q_heads),
        BLOCK_KH=next_pow2(num_k_heads), BLOCK_HALF=next_pow2(head_size // 2), num_warps=4)
    return query, key
