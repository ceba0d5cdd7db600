"""RMSNorm, optionally fused with the residual add that precedes it in a Llama block."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without `residual`: `norm(x)`. With it: `s = x + residual`, returns `(norm(s), s)`.

    Matches Hugging Face's LlamaRMSNorm: statistics in float32, scaled in the input dtype.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, residual)
