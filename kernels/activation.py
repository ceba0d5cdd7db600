"""SiLU-and-multiply, the gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., 2I]` holds gate then up projections; returns `silu(gate) * up` `[..., I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
