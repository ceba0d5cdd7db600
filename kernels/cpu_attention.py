"""Paged attention on the CPU, compiled from csrc/: decode (paged_decode_cpu.cpp) and
prefill/extend (paged_prefill_cpu.cpp), both reading K/V in place through the block table.

Defined by `paged_decode_attention_ref` and `paged_prefill_attention_ref` in
kernels/paged_attention.py: same inputs, same outputs. If no compiler is available the caller
falls back to the references.
"""

from __future__ import annotations

import torch
from streamer_kernels.cpu_extension import load, module

__all__ = ["load", "paged_decode_attention_cpu", "paged_prefill_attention_cpu", "prefill_products"]


def paged_decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               window: int = 0, softcap: float = 0.0, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor:
    """`window` > 0: each sequence attends to its last `window` positions only (sliding window);
    `softcap` > 0: scores capped by softcap * tanh(score / softcap). An fp8 e4m3 cache is read as
    `value * k_scale` / `value * v_scale` (float32 or bfloat16 queries, head sizes a multiple of 16)."""
    return module().paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, window,
                                           softcap, k_scale, v_scale)


def paged_prefill_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, products: str = "auto",
                                out: torch.Tensor | None = None, window: int = 0,
                                softcap: float = 0.0) -> torch.Tensor:
    """float32 and bfloat16. `query_start_loc` may be offset (the backend passes the rows after
    the step's decodes): only differences between its entries count. `products`: what the
    kernel's tiles multiply on, "auto" (the fastest this CPU has) or one of
    `prefill_products(dtype)`: "float32" (register tiles, any CPU: bfloat16 widened), "bf16_dot"
    (vdpbf16ps, AVX-512 BF16), "amx" (bfloat16 on the tile matrix unit of CPUs with AMX).
    `query`'s token rows may be strided (a view of the fused QKV output is read in place); the
    result goes into `out` (contiguous, the query's shape and dtype) when given, and is returned.
    `window` > 0: sliding-window attention; key tiles wholly before every row's window are skipped.
    `softcap` > 0: scores capped by softcap * tanh(score / softcap)."""
    return module().paged_prefill_attention(query, key_cache, value_cache, block_tables,
                                            query_start_loc.to(torch.int32), seq_lens.to(torch.int32), scale,
                                            products, out, window, softcap)


def prefill_products(dtype: torch.dtype) -> list[str]:
    """The `products` of `paged_prefill_attention_cpu` this CPU runs for `dtype`."""
    return module().prefill_products(dtype)
