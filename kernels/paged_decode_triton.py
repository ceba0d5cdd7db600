"""Triton paged decode attention; defined by `streamer_kernels.paged_attention.paged_decode_attention_ref`.

One program per (sequence, KV head[, split]): it loads each K/V row of its group once and
serves all the query heads that share it (GQA), so the kernel moves the cache once. Long
contexts with few sequences cannot fill the GPU that way, so they are cut into partitions
("split-K" / flash-decoding), each written as a normalised partial output plus its
log-sum-exp, and a second kernel merges the partitions.
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

BLOCK_N = 32  # cache rows per inner step; independent of the cache's block size
MIN_SPLIT_SEQ_LEN = 1024  # below this a single pass is cheap enough whatever the batch
MIN_PARTITION = 256  # tokens per split: smaller partitions cost more in the merge than they gain
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr, scale_log2,
                   q_stride_b, q_stride_h, o_stride_b, o_stride_h, o_stride_s, lse_stride_b,
                   lse_stride_h, bt_stride, c_stride_b, c_stride_s, c_stride_h,
                   group, head_size, block_size, partition, window, softcap, k_scale, v_scale,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * partition
    if start >= seq_len:  # this partition lies past the end of this (shorter) sequence
        return
    end = tl.minimum(seq_len, start + partition)
    if WINDOW:  # the last `window` positions only; a partition before them adds nothing (lse -inf)
        start = tl.maximum(start, seq_len - window)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * group + g
    gmask = g < group
    dmask = d < head_size
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(DOT_DTYPE)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        m, denom, acc = paged_attention_step(
            q, m, denom, acc, kc_ptr, vc_ptr, bt_ptr + b * bt_stride, pos, pmask, pmask[None, :], kvh, d,
            dmask, c_stride_b, c_stride_s, c_stride_h, block_size, scale_log2, softcap, k_scale, v_scale, DOT_DTYPE,
            PRECISION, SOFTCAP, KV_FP8)

    l_safe = tl.where(denom > 0.0, denom, 1.0)  # an empty sequence gives zeros rather than NaN
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + b * o_stride_b + heads[:, None] * o_stride_h + d[None, :]
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * o_stride_s, out, mask=omask)
        tl.store(lse_ptr + b * lse_stride_b + heads * lse_stride_h + split, m + tl.log2(l_safe),
                 mask=gmask)
    else:
        tl.store(o_ptrs, cast_rtne(out, out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, seq_lens_ptr, out_ptr, partition, head_size,
                  p_stride_b, p_stride_h, p_stride_s, lse_stride_b, lse_stride_h,
                  o_stride_b, o_stride_h, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # Weighted sum of the partitions' normalised outputs: weight = exp(lse_s - logsumexp(lse)).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    num_valid = tl.cdiv(tl.load(seq_lens_ptr + b), partition)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_valid
    lse = tl.load(lse_ptr + b * lse_stride_b + h * lse_stride_h + s, mask=smask, other=float("-inf"))
    w = tl.where(smask, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
    parts = tl.load(part_ptr + b * p_stride_b + h * p_stride_h + s[:, None] * p_stride_s + d[None, :],
                    mask=smask[:, None] & (d < head_size)[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + b * o_stride_b + h * o_stride_h + d, cast_rtne(out, out_ptr.dtype.element_ty),
             mask=d < head_size)


def decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many partitions to cut each context into: 1 (single pass) unless the context is long
    and `batch * num_kv_heads` programs would leave most of the `num_sms` multiprocessors idle."""
    programs = batch * num_kv_heads
    target = 2 * num_sms  # two programs per SM hide most of the load latency
    if max_seq_len < MIN_SPLIT_SEQ_LEN or programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_seq_len // MIN_PARTITION, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: splitting never pays there


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, out: torch.Tensor | None = None,
                           num_splits: int | None = None, window: int = 0, softcap: float = 0.0,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Same contract as `paged_decode_attention_ref` (`window`, `softcap`, an fp8 cache's
    `k_scale` / `v_scale` included); writes into
    `out` when given.

    `num_splits` forces the number of partitions (tests); by default `decode_num_splits` picks it
    from the context length, the batch and the GPU. With more than one, `max_seq_len` must bound
    every `seq_lens[b]`: the partitions are cut from it.
    """
    batch, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_attention_args(query, key_cache, value_cache, num_heads, num_kv_heads)
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # a device sync: the engine passes it in
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_seq_len, _num_sms(query.device))
    partition = triton.cdiv(triton.cdiv(max_seq_len, num_splits), BLOCK_N) * BLOCK_N
    num_splits = max(1, triton.cdiv(max_seq_len, partition))
    if num_splits == 1:
        partition = 1 << 30  # one pass covers whatever each sequence holds, whatever max_seq_len said
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_size))
    common = dict(BLOCK_G=max(16, next_pow2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
                  DOT_DTYPE=dot_dtype(query.dtype), PRECISION=dot_precision(query.dtype),
                  num_warps=attention_num_warps(query.dtype), WINDOW=window > 0, SOFTCAP=softcap > 0,
                  KV_FP8=key_cache.dtype == torch.float8_e4m3fn)
    scale_log2 = scale * math.log2(math.e)
    kv_strides = (block_tables.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    dims = (group, head_size, block_size)
    options = (window, float(softcap), float(k_scale), float(v_scale))
    if num_splits == 1:
        _decode_kernel[(batch, num_kv_heads, 1)](
            query, key_cache, value_cache, block_tables, seq_lens, out, out, scale_log2,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), 0, 0, 0, *kv_strides,
            *dims, partition, *options, SPLIT=False, **common)
        return out
    parts = torch.empty((batch, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, parts, lse, scale_log2,
        query.stride(0), query.stride(1), parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1), *kv_strides, *dims, partition, *options, SPLIT=True, **common)
    _merge_kernel[(batch, num_heads)](
        parts, lse, seq_lens, out, partition, head_size, parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, num_warps=4)
    return out

