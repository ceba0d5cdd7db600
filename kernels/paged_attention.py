"""Attention over the paged KV cache: the plain-torch definitions.

Decode: one query token per sequence. Prefill/extend: a variable number of new tokens per
sequence, causal among themselves, attending to everything already cached before them. In both
cases the new tokens' K/V are already written into the cache (see cache_ops).

Two per-layer options, as Gemma's and Mistral's layers need them:
- `window` > 0: sliding-window attention. The query at position p attends to keys at positions
  `p - window < k <= p` (transformers' sliding mask: `window` keys, itself included); keys before
  the window are not read at all.
- `softcap` > 0: every scaled score s becomes `softcap * tanh(s / softcap)` before the softmax
  (Gemma 2).

An fp8 (e4m3) cache holds `k / k_scale` and `v / v_scale` (kernels/fp8.py); it is read back as
`fp8 * scale` rounded to the query's dtype, then attended exactly as a cache of that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from streamer_kernels.fp8 import dequantize_fp8_ref, is_fp8


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, start: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Gather `[B, max_len, kv_heads, head_size]` from the paged cache through the block tables:
    positions `start[b] + i` (`start` defaults to 0).

    Positions past a sequence's length read whatever its table points to; callers mask them.
    """
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    pos = torch.arange(max_len, device=cache.device)[None, :].expand(block_tables.shape[0], -1)
    if start is not None:
        pos = pos + start[:, None].long()
    pos = pos.clamp(max=block_tables.shape[1] * block_size - 1)  # positions past a table's end are masked
    blocks = torch.gather(block_tables.long(), 1, pos // block_size)
    slots = blocks * block_size + pos % block_size
    return cache.view(-1, num_kv_heads, head_size)[slots]


def _read(kv: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache values in the query's dtype (fp8 dequantized with its scale)."""
    return dequantize_fp8_ref(kv, scale, dtype) if is_fp8(kv) else kv


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float) -> torch.Tensor:
    """`q` `[B, H, Lq, D]` over `k`, `v` `[B, KVH, Lk, D]`; `mask` `[B or 1, 1, Lq, Lk]` (True:
    attend) or None for plain causal attention with Lq == Lk."""
    gqa = q.shape[1] != k.shape[1]
    if not softcap:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # Capped scores cannot go through the fused kernel: the products spelled out, as transformers'
    # eager attention computes them (softmax in float32, weights back in the input dtype).
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               max_seq_len: int | None = None, window: int = 0,
                               softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`query` `[B, H, D]` -> `[B, H, D]`: each sequence attends to its first `seq_lens[b]` slots
    (its last `window` of them when `window` > 0).

    `block_tables` `[B, max_blocks]` int32, `seq_lens` `[B]` int32. GQA: H is a multiple of the
    cache's kv_heads; query head h reads kv head h // (H // kv_heads).
    """
    max_len = int(max_seq_len if max_seq_len is not None else seq_lens.max())
    lens = seq_lens.long()
    start = None
    if window:
        start = (lens - window).clamp(min=0)
        max_len = min(max_len, window)
    k = _read(gather_kv(key_cache, block_tables, max_len, start), k_scale, query.dtype).transpose(1, 2)
    v = _read(gather_kv(value_cache, block_tables, max_len, start), v_scale, query.dtype).transpose(1, 2)
    kept = lens if start is None else lens - start
    valid = torch.arange(max_len, device=query.device)[None, :] < kept[:, None]
    out = _attend(query.unsqueeze(2), k, v, valid[:, None, None, :], scale, softcap)
    return out.squeeze(2)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, window: int = 0,
                                softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`query` `[T, H, D]` (new tokens of all sequences, concatenated) -> `[T, H, D]`.

    Sequence b owns query rows `query_start_loc[b]:query_start_loc[b+1]` (relative to
    `query_start_loc[0]`, so a slice of a larger batch's offsets works); its new tokens are the
    last ones of its `seq_lens[b]` cached tokens, so new token i sits at position
    `seq_lens[b] - q_len + i` and attends to positions `<=` that (and, with `window`, `>` that
    minus `window`).
    """
    out = torch.empty_like(query)
    starts = [x - int(query_start_loc[0]) for x in query_start_loc.tolist()]  # may be a slice of a batch
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # The first key any of these queries reads: the window of the first new token.
        first = max(0, seq_len - q_len - window + 1) if window else 0
        # 4-D [1, heads, len, D]: PyTorch's fused CPU (flash) kernel takes only batched inputs and
        # silently falls back to the slow "math" path for 3-D ones (4-5x slower at 1.5k tokens).
        at = torch.tensor([first], device=query.device)
        k = _read(gather_kv(key_cache, block_tables[b:b + 1], seq_len - first, at), k_scale,
                  query.dtype).transpose(1, 2)  # [1, KVH, L, D]
        v = _read(gather_kv(value_cache, block_tables[b:b + 1], seq_len - first, at), v_scale,
                  query.dtype).transpose(1, 2)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        mask = None  # nothing cached before and no window: plain causal attention, no mask to build
        if q_len != seq_len or window:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(first, seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
            mask = mask[None, None]
        out[q_start:q_end] = _attend(q, k, v, mask, scale, softcap)[0].transpose(0, 1)
    return out
