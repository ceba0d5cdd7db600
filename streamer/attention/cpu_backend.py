"""The CPU backend: attention (decode and prefill) and the per-token ops compiled for the CPU
(C++ in kernels/csrc/), the torch references for the rest. Attention reads K/V in place through
the block table instead of gathering a dense copy first; RMSNorm, rotary, SiLU-and-mul and the
cache write are one pass each instead of 2-8 ATen ops. Falls back to the references where the
kernels cannot be built, and for float16 (the kernels do float32 and bfloat16, rounding bfloat16
where the references round). Sliding windows (keys before a query's window are not read) and
soft-capped scores (Gemma 2) are compiled too."""

from __future__ import annotations

import torch
from streamer_kernels.cpu_attention import load, paged_decode_attention_cpu, paged_prefill_attention_cpu
from streamer_kernels.elementwise_cpu import reshape_and_cache_cpu, rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu

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
                 value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        if not self._fast(key):
            return super().write_kv(key, value, key_cache, value_cache, meta)
        reshape_and_cache_cpu(key, value, key_cache, value_cache, meta.slot_mapping)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               out: torch.Tensor, window: int = 0, softcap: float = 0.0) -> None:
        if not self.compiled:
            return super().decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out,
                                  window, softcap)
        out.copy_(paged_decode_attention_cpu(query, key_cache, value_cache, block_tables, seq_lens, scale, window,
                                             softcap))

    def prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                max_query_len: int, out: torch.Tensor, window: int = 0, softcap: float = 0.0) -> None:
        if not self._fast(query):
            return super().prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                   max_query_len, out, window, softcap)
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
