"""RMSNorm as the decoder layers call it: through the backend, optionally fused with the residual add."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.attention.backend import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


def norm_heads(norm: RMSNorm, x: torch.Tensor, head_size: int) -> torch.Tensor:
    """`norm` over each head of `x` `[T, heads * head_size]` (Qwen3's and Gemma 3's q/k norms).
    `x` is usually a column slice of the fused QKV output: reshape copies it into rows of one head."""
    return norm(x.reshape(-1, head_size)).view(x.shape[0], -1)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + w): the checkpoint's w is loaded as 1 + w (in float32), so the
    kernels are Llama's. In float32 that is transformers' arithmetic exactly; in bfloat16 the sum is
    rounded once more than transformers rounds it."""

    def __init__(self, hidden_size: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__(hidden_size, eps, backend)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        param.data.copy_(loaded[:].float() + 1.0)
