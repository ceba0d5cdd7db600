"""KV-cache writes and block copies.

Cache layout (per layer, one tensor for keys and one for values):
`[num_blocks, block_size, num_kv_heads, head_size]`. A slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `key`/`value` `[T, kv_heads, head_size]` into the cache slots `slot_mapping` `[T]`."""
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def copy_blocks_ref(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
    """For every layer, copy block `src` to block `dst` for each row `(src, dst)` of `block_mapping`."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))
