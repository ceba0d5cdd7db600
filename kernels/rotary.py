"""Rotary position embedding (Llama / GPT-NeoX style: rotate the two halves of each head)."""

from __future__ import annotations

import torch


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` `[T, H*D]` and `key` `[T, KVH*D]` in place by their `positions` `[T]`.

    `cos_sin_cache` is `[max_position, D]`: cos of the D/2 frequencies, then their sin (any
    scaling such as llama3's is already folded into it). Returns the same two tensors.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)
        x1, x2 = heads.chunk(2, dim=-1)
        c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        heads.copy_(rotated)
    return query, key
