"""Triton KV-cache writes and block copies; defined by `streamer_kernels.cache_ops`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from streamer_kernels.triton_utils import next_pow2, round_to_e4m3


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, num_kv_heads, head_size,
                              block_size, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                              c_stride_b, c_stride_s, c_stride_h, k_scale, v_scale,
                              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    # One program per new token: copy its [kv_heads, head_size] key and value into its slot.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token (vLLM convention): nothing to store
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_size)
    dst = (slot // block_size) * c_stride_b + (slot % block_size) * c_stride_s + h * c_stride_h + d
    k = tl.load(key_ptr + tok * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(value_ptr + tok * v_stride_t + h * v_stride_h + d, mask=mask)
    if FP8:  # x / scale saturated at e4m3's +-448, rounded as torch rounds (kernels/fp8.py: quantize_fp8_ref)
        k = round_to_e4m3(tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -448.0), 448.0))
        v = round_to_e4m3(tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0))
        k = k.to(kc_ptr.dtype.element_ty)
        v = v.to(vc_ptr.dtype.element_ty)
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Same contract as `reshape_and_cache_ref` (an fp8 cache quantized with k_scale / v_scale); a
    negative slot skips that token."""
    num_tokens, num_kv_heads, head_size = key.shape
    fp8 = key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn
    if key_cache.stride() != value_cache.stride() or not fp8 and (key_cache.dtype != key.dtype
                                                                   or value_cache.dtype != value.dtype):
        raise ValueError("key/value caches must share a layout and match the dtype of key/value")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("head_size must be the contiguous dimension of key, value and the caches")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_size, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), float(k_scale), float(v_scale),
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_size), FP8=fp8, num_warps=4)


@triton.jit
def _copy_blocks_kernel(cache_ptr, mapping_ptr, block_numel, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    tl.store(cache_ptr + dst * block_numel + offs,
             tl.load(cache_ptr + src * block_numel + offs, mask=mask), mask=mask)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Same contract as `copy_blocks_ref`: one launch per cache tensor (copy-on-write is rare)."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.contiguous()
    for cache in (*key_caches, *value_caches):
        if not cache.is_contiguous():
            raise ValueError("copy_blocks needs contiguous caches")
        block_numel = cache[0].numel()
        block = min(4096, next_pow2(block_numel))
        _copy_blocks_kernel[(mapping.shape[0], triton.cdiv(block_numel, block))](
            cache, mapping, block_numel, BLOCK=block, num_warps=4)
