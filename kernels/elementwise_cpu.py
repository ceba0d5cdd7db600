"""RMSNorm, rotary embedding, SiLU-and-mul, the KV-cache write and greedy argmax compiled for the
CPU (csrc/elementwise_cpu.cpp), float32 and bfloat16. Defined by `rms_norm_ref`,
`rotary_embedding_ref`, `silu_and_mul_ref`, `reshape_and_cache_ref` and `argmax_ref`: same inputs, same outputs
(bfloat16 rounded where the references round); the residual form updates its inputs in place,
as vLLM's does."""

from __future__ import annotations

import torch
from streamer_kernels.cpu_extension import module


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As `rms_norm_ref`; with `residual`, writes `x + residual` into `residual` and the norm into
    `x`, and returns those two tensors."""
    if residual is None:
        return module().rms_norm(x, weight, eps)
    module().fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding_cpu(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    module().rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    return query, key


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    return module().silu_and_mul(x)


def reshape_and_cache_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    module().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    return module().argmax_rows(logits)


def nucleus_threshold_cpu(weights: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """As `nucleus_threshold_ref` (kernels/nucleus.py), for float32 rows on the CPU (csrc/nucleus_cpu.cpp)."""
    return module().nucleus_threshold_rows(weights, limit)


def nucleus_weights_cpu(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor) -> torch.Tensor:
    """As `nucleus_weights_ref` (kernels/nucleus.py), for float32 rows on the CPU (csrc/nucleus_cpu.cpp):
    one pass weighs and histograms each row, where the reference takes eight over the whole batch."""
    return module().nucleus_weights_rows(logits, temperature, top_p, min_p)
