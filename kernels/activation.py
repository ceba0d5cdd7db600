"""The gated activations of the MLPs: SiLU-and-multiply (Llama), GELU(tanh)-and-multiply (Gemma's GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., 2I]` holds gate then up projections; returns `silu(gate) * up` `[..., I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., 2I]` holds gate then up projections; returns `gelu_tanh(gate) * up` `[..., I]`
    (transformers' `gelu_pytorch_tanh`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
