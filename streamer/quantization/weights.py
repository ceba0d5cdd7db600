"""A linear layer's quantized weight: it replaces the dense weight in the layer's `packed` slot,
and `streamer.layers.cpu_gemm.linear` calls its `apply` instead of a dense GEMM."""

from __future__ import annotations

from typing import Protocol

import torch


class QuantizedWeight(Protocol):
    in_features: int
    out_features: int

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x [..., in] -> [..., out]` in x's dtype."""
        ...

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense `[out, in]` weight this one stands for (the reference model's weight)."""
        ...
