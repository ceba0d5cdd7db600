"""The CPU backend: attention (decode and prefill) and the per-token ops compiled for the CPU
(C++ in kernels/csrc/), the torch references for the rest. Attention reads K/V in place through
the block table instead of gathering a dense copy first; RMSNorm, rotary, SiLU-and-mul and the
cache write are one pass each instead of 2-8 ATen ops. Falls back to the references where the
kernels cannot be built, and for float16 (the kernels do float32 and bfloat16, rounding bfloat16
where the references round). Sliding windows (keys before a query's window are not read) and
soft-capped scores (Gemma 2) are compiled too.

An fp8 KV cache (kv_cache_dtype="fp8"): the cache write quantizes, then copies bytes; decode reads
the fp8 rows in place (widened and scaled, csrc/fp8_cpu.h); prefill dequantizes the blocks its
sequences read, once per layer, and runs the float kernel on them (a prompt's attention does far
more arithmetic per key than that one pass)."""

from __future__ import annotations

import torch
from streamer_kernels.cpu_attention import load, paged_decode_attention_cpu, paged_prefill_attention_cpu
from streamer_kernels.elementwise_cpu import reshape_and_cache_cpu, rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu
from streamer_kernels.fp8 import dequantize_fp8_ref, is_fp8, quantize_fp8_ref

from streamer.attention.backend import AttentionMetadata
from streamer.attention.torch_backend import TorchBackend

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.compiled = load() is not None

    def _fast(self, x: torch.Tensor) -> bool:
        return self.compiled and x.dtype in _KERNEL_DTYPES and x.device.type == "cpu"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        if not self._fast(key):
            return super().write_kv(key, value, key_cache, value_cache, meta, k_scale, v_scale)
        if is_fp8(key_cache):  # the kernel copies rows bytewise: quantized rows in, fp8 bytes out
            key, value = quantize_fp8_ref(key, k_scale), quantize_fp8_ref(value, v_scale)
        reshape_and_cache_cpu(key, value, key_cache, value_cache, meta.slot_mapping)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
               v_scale: float = 1.0) -> None:
        if not self.compiled or (is_fp8(key_cache) and not self._fp8_decode(query)):
            return super().decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out,
                                  window, softcap, k_scale, v_scale)
        out.copy_(paged_decode_attention_cpu(query, key_cache, value_cache, block_tables, seq_lens, scale, window,
                                             softcap, k_scale, v_scale))

    def _fp8_decode(self, query: torch.Tensor) -> bool:
        """Whether the compiled decode reads an fp8 cache for this query (its vector path: float32 or
        bfloat16, head sizes a multiple of 16 floats)."""
        return self._fast(query) and query.shape[-1] % 16 == 0

    def prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                max_query_len: int, out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:
        if not self._fast(query):
            return super().prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                   max_query_len, out, window, softcap, k_scale, v_scale)
        if is_fp8(key_cache):
            key_cache, value_cache, block_tables = dequantized_blocks(key_cache, value_cache, block_tables, seq_lens,
                                                                      k_scale, v_scale, query.dtype)
        paged_prefill_attention_cpu(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                    out=out, window=window, softcap=softcap)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self._fast(x):
            return super().rms_norm(x, weight, eps, residual)
        return rms_norm_cpu(x, weight, eps, residual)

    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fast(query):
            return super().rotary(positions, query, key, cos_sin_cache, head_size)
        return rotary_embedding_cpu(positions, query, key, cos_sin_cache, head_size)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fast(x):
            return super().silu_and_mul(x)
        return silu_and_mul_cpu(x)


def dequantized_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks these sequences read, dequantized into a small cache of `dtype`, and block tables
    into it (sequence b's j-th block is block `b * width + j`)."""
    block_size = key_cache.shape[1]
    width = -(-int(seq_lens.max()) // block_size)
    ids = block_tables[:, :width].reshape(-1).long()
    keys = dequantize_fp8_ref(key_cache[ids], k_scale, dtype)
    values = dequantize_fp8_ref(value_cache[ids], v_scale, dtype)
    tables = torch.arange(ids.numel(), dtype=torch.int32).view(-1, width)
    return keys, values, tables
