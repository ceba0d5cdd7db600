"""fp8 (e4m3, the `float8_e4m3fn` format: max 448, no infinities) quantization: the references for
fp8 weights (a linear layer computed on dequantized weights) and for the fp8 KV cache (values
stored as `x / scale`, read back as `fp8 * scale`, one float scale per layer for keys and one for
values, as vLLM's `k_scale` / `v_scale`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_fp8_ref(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """`x / scale` rounded to e4m3 (nearest even), saturated at +-448: e4m3fn has no infinity, and
    an unsaturated cast of a value past 448 gives NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8_ref(q: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q * scale` in float32, then rounded to `dtype`."""
    return (q.float() * scale).to(dtype)


def quantize_weight_fp8_ref(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel fp8: `(q [out, in] e4m3, scale [out] float32)`, `scale = max|row| / 448`
    (a zero row gets 1), so every row uses the format's whole range."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return quantize_fp8_ref(w, scale[:, None]), scale


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x . (q * scale)^T + bias` with the weights dequantized to float32, rounded to x's dtype."""
    y = F.linear(x.float(), q.float() * scale.float()[:, None])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8
