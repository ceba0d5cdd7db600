"""The attention-backend interface: how a model layer reads and writes the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from streamer_kernels.activation import gelu_tanh_and_mul_ref


@dataclass
class AttentionMetadata:
    """One step's flat batch, shared by all layers.

    Sequences are ordered decodes first (`query_len == 1`), then prefills/extends. Token rows of
    sequence b are `query_start_loc[b]:query_start_loc[b+1]`; its context after this step is
    `seq_lens[b]` tokens, the new ones last.
    """

    num_decodes: int
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int


@dataclass
class Rows:
    """Some rows of a step (`index` into its tokens) and their attention metadata, for a layer that
    computes those rows alone past its K/V (step.sample_rows_meta: each a decode over its context)."""

    index: torch.Tensor
    meta: AttentionMetadata


class AttentionBackend(ABC):
    """Stateless kernels over per-layer caches `[num_blocks, block_size, num_kv_heads, head_size]`."""

    name: str = ""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """Store this step's `key`/`value` `[T, kv_heads, head_size]` at `meta.slot_mapping` (an fp8
        cache gets `key / k_scale` and `value / v_scale`, kernels/cache_ops.py)."""

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Attention of `query` `[T, heads, head_size]` over the cache (after `write_kv`):
        decodes and prefills fill disjoint row ranges of one output. `window` > 0: sliding-window
        attention over that many keys; `softcap` > 0: capped scores (kernels/paged_attention.py);
        `k_scale` / `v_scale`: an fp8 cache's scales."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # dense: `query` may be a strided view
        nd = meta.num_decodes
        if nd:
            self.decode(query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                        meta.max_decode_seq_len, out[:nd], window, softcap, k_scale, v_scale)
        if nd < meta.seq_lens.shape[0]:
            self.prefill(query[nd:], key_cache, value_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                         meta.seq_lens[nd:], scale, meta.max_query_len, out[nd:], window, softcap, k_scale, v_scale)
        return out

    @abstractmethod
    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
               v_scale: float = 1.0) -> None:
        """One query token per sequence (kernels/paged_attention.py: paged_decode_attention_ref)."""

    @abstractmethod
    def prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                max_query_len: int, out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:
        """New tokens over cached context (kernels/paged_attention.py: paged_prefill_attention_ref);
        `query_start_loc` may be a slice of the batch's offsets (rows relative to its first)."""

    @abstractmethod
    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        """Copy whole blocks `(src, dst)` rows of `block_mapping` `[N, 2]` in every layer."""

    # Elementwise ops the model calls; the torch backend uses the references in kernels/.
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ...

    @abstractmethod
    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU (kernels/activation.py); the reference unless a backend compiles it."""
        return gelu_tanh_and_mul_ref(x)
