"""KV-cache writes and block copies.

Cache layout (per layer, one tensor for keys and one for values):
`[num_blocks, block_size, num_kv_heads, head_size]`. A slot is `block_id * block_size + offset`.
An fp8 cache stores `key / k_scale` and `value / v_scale` as e4m3 (kernels/fp8.py).
"""

from __future__ import annotations

import torch
from streamer_kernels.fp8 import is_fp8, quantize_fp8_ref


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
    """Store `key`/`value` `[T, kv_heads, head_size]` into the cache slots `slot_mapping` `[T]`."""
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    if is_fp8(key_cache):  # torch's CPU index_copy_ has no fp8: the same bytes as uint8
        key = quantize_fp8_ref(key, k_scale).view(torch.uint8)
        value = quantize_fp8_ref(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def copy_blocks_ref(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
    """For every layer, copy block `src` to block `dst` for each row `(src, dst)` of `block_mapping`."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache = cache.view(torch.uint8) if is_fp8(cache) else cache  # no fp8 index_copy_ on the CPU
        cache.index_copy_(0, dst, cache.index_select(0, src))
