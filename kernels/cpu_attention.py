"""Paged decode attention compiled for the CPU (csrc/paged_decode_cpu.cpp).

Defined by `paged_decode_attention_ref` in kernels/paged_attention.py: same inputs, same output.
If no compiler is available the caller falls back to the reference.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import load, module

__all__ = ["load", "paged_decode_attention_cpu"]


def paged_decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return module().paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
