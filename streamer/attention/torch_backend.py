"""The plain-torch backend: the references in kernels/, used on CPU and as ground truth."""

from __future__ import annotations

import torch
from streamer_kernels.activation import silu_and_mul_ref
from streamer_kernels.cache_ops import copy_blocks_ref, reshape_and_cache_ref
from streamer_kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from streamer_kernels.rms_norm import rms_norm_ref
from streamer_kernels.rotary import rotary_embedding_ref

from streamer.attention.backend import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
               v_scale: float = 1.0) -> None:
        out.copy_(paged_decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                             max_seq_len, window, softcap, k_scale, v_scale))

    def prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                max_query_len: int, out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:
        out.copy_(paged_prefill_attention_ref(query, key_cache, value_cache, block_tables, query_start_loc,
                                              seq_lens, scale, window, softcap, k_scale, v_scale))

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        copy_blocks_ref(key_caches, value_caches, block_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_ref(x, weight, eps, residual)

    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)
