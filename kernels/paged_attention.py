"""Attention over the paged KV cache: the plain-torch definitions.

Decode: one query token per sequence. Prefill/extend: a variable number of new tokens per
sequence, causal among themselves, attending to everything already cached before them. In both
cases the new tokens' K/V are already written into the cache (see cache_ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Gather `[B, max_len, kv_heads, head_size]` from the paged cache through the block tables.

    Positions past a sequence's length read whatever its table points to; callers mask them.
    """
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    pos = torch.arange(max_len, device=cache.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    return cache.view(-1, num_kv_heads, head_size)[slots]


def paged_decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               max_seq_len: int | None = None) -> torch.Tensor:
    """`query` `[B, H, D]` -> `[B, H, D]`: each sequence attends to its first `seq_lens[b]` slots.

    `block_tables` `[B, max_blocks]` int32, `seq_lens` `[B]` int32. GQA: H is a multiple of the
    cache's kv_heads; query head h reads kv head h // (H // kv_heads).
    """
    max_len = int(max_seq_len if max_seq_len is not None else seq_lens.max())
    k = gather_kv(key_cache, block_tables, max_len).transpose(1, 2)  # [B, KVH, L, D]
    v = gather_kv(value_cache, block_tables, max_len).transpose(1, 2)
    valid = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None].long()
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=query.shape[1] != k.shape[1])
    return out.squeeze(2)


def paged_prefill_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`query` `[T, H, D]` (new tokens of all sequences, concatenated) -> `[T, H, D]`.

    Sequence b owns query rows `query_start_loc[b]:query_start_loc[b+1]` (relative to
    `query_start_loc[0]`, so a slice of a larger batch's offsets works); its new tokens are the
    last ones of its `seq_lens[b]` cached tokens, so new token i sits at position
    `seq_lens[b] - q_len + i` and attends to positions `<=` that.
    """
    out = torch.empty_like(query)
    starts = [x - int(query_start_loc[0]) for x in query_start_loc.tolist()]  # may be a slice of a batch
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # 4-D [1, heads, len, D]: PyTorch's fused CPU (flash) kernel takes only batched inputs and
        # silently falls back to the slow "math" path for 3-D ones (4-5x slower at 1.5k tokens).
        k = gather_kv(key_cache, block_tables[b:b + 1], seq_len).transpose(1, 2)  # [1, KVH, L, D]
        v = gather_kv(value_cache, block_tables[b:b + 1], seq_len).transpose(1, 2)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        gqa = q.shape[1] != k.shape[1]
        if q_len == seq_len:  # nothing cached before: plain causal attention, no mask to build
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
