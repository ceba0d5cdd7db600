"""Triton prefill/extend attention over the paged cache; defined by
`streamer_kernels.paged_attention.paged_prefill_attention_ref`.

One program per (tile of new tokens, sequence, KV head). A tile's rows are (token, query head)
pairs of one KV group, so every K/V row loaded serves all heads that share it (GQA). Each new
token attends to the cached context before it (prefix-cache hits, earlier chunks of a chunked
prefill) and causally to the new tokens up to itself; softmax is computed online.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from streamer_kernels.triton_utils import (
    attention_num_warps,
    cast_rtne,
    check_attention_args,
    dot_dtype,
    dot_precision,
    next_pow2,
    paged_attention_step,
)

BLOCK_M = 64  # (token, head) rows per program
BLOCK_N = 32  # cache rows per inner step


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, scale_log2,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride,
                    c_stride_b, c_stride_s, c_stride_h, head_size, block_size, window, softcap, k_scale, v_scale,
                    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2)
    # query_start_loc may be a slice of a larger batch's (decodes first): rows are relative to it.
    first = tl.load(qsl_ptr)
    q_start = tl.load(qsl_ptr + b) - first
    q_len = tl.load(qsl_ptr + b + 1) - first - q_start
    tok0 = tile * TOKENS
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len  # tokens cached before this step's new ones

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    rmask = (r < TOKENS * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_size
    qmask = rmask[:, None] & dmask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=qmask, other=0.0).to(DOT_DTYPE)
    q_pos = ctx_len + tok  # padded rows still see key 0, so no row is ever fully masked

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + tok0 + TOKENS)  # the tile's last token sees no further
    kv_start = 0
    if WINDOW:  # keys before the window of the tile's first token are not read
        kv_start = tl.maximum(0, ctx_len + tok0 - window + 1)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < kv_end
        allowed = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        m, denom, acc = paged_attention_step(
            q, m, denom, acc, kc_ptr, vc_ptr, bt_ptr + b * bt_stride, pos, pmask, allowed, kvh, d, dmask,
            c_stride_b, c_stride_s, c_stride_h, block_size, scale_log2, softcap, k_scale, v_scale, DOT_DTYPE, PRECISION,
            SOFTCAP, KV_FP8)

    out = acc / denom[:, None]
    tl.store(out_ptr + q_rows[:, None] * o_stride_t + heads[:, None] * o_stride_h + d[None, :],
             cast_rtne(out, out_ptr.dtype.element_ty), mask=qmask)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, max_query_len: int | None = None,
                            out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Same contract as `paged_prefill_attention_ref` (`window`, `softcap`, an fp8 cache's
    `k_scale` / `v_scale` included); writes into
    `out` when given.

    `query_start_loc` may start at a nonzero offset (a slice of a mixed batch's): rows are taken
    relative to its first entry. `max_query_len`, when given, must bound every sequence's number
    of new tokens (it sizes the grid).
    """
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_attention_args(query, key_cache, value_cache, num_heads, num_kv_heads)
    if out is None:
        out = torch.empty_like(query)
    batch = seq_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # device sync
    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M, next_pow2(group))
    tokens = block_m // group
    grid = (triton.cdiv(max_query_len, tokens), batch, num_kv_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        scale * math.log2(math.e), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        head_size, block_size, window, float(softcap), float(k_scale), float(v_scale), GROUP=group, TOKENS=tokens,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, next_pow2(head_size)), DOT_DTYPE=dot_dtype(query.dtype),
        PRECISION=dot_precision(query.dtype), num_warps=attention_num_warps(query.dtype), WINDOW=window > 0,
        SOFTCAP=softcap > 0, KV_FP8=key_cache.dtype == torch.float8_e4m3fn)
    return out
