"""The Triton backend: the kernels in kernels/*_triton.py. Selected on CUDA; on CPU it runs only
under the Triton interpreter (`TRITON_INTERPRET=1`), which the tests use to check it."""

from __future__ import annotations

import torch
from streamer_kernels.activation_triton import gelu_tanh_and_mul, silu_and_mul
from streamer_kernels.cache_ops_triton import copy_blocks, reshape_and_cache
from streamer_kernels.paged_decode_triton import paged_decode_attention
from streamer_kernels.paged_prefill_triton import paged_prefill_attention
from streamer_kernels.rms_norm_triton import rms_norm
from streamer_kernels.rotary_triton import rotary_embedding
from streamer_kernels.triton_utils import interpreting

from streamer.attention.backend import AttentionBackend, AttentionMetadata
from streamer.errors import ConfigError


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        # Without this, the first launch fails with Triton's "0 active drivers".
        if not interpreting() and not torch.cuda.is_available():
            raise ConfigError("attention_backend='triton' needs a CUDA GPU; on CPU use 'auto' (the default) or "
                              "'cpu', or set TRITON_INTERPRET=1 to run the Triton kernels slowly for testing")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)

    # Decodes and prefills write disjoint row ranges of one output; no copies, no host syncs
    # (the lengths the grids need come from the metadata's Python ints).
    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
               v_scale: float = 1.0) -> None:
        paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out=out,
                               window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)

    def prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                max_query_len: int, out: torch.Tensor, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:
        paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                max_query_len, out=out, window=window, softcap=softcap, k_scale=k_scale,
                                v_scale=v_scale)

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        copy_blocks(key_caches, value_caches, block_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, weight, eps, residual)

    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, query, key, cos_sin_cache, head_size)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)
