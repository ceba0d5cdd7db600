"""fp8 weights on GPUs with fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell):
`torch._scaled_mm` on e4m3 operands, defined by `fp8_linear_ref` (kernels/fp8.py).

The activations are quantized per row at each call (`max|row| / 448`, vLLM's dynamic per-token
scheme) and the weights carry one scale per output channel, so the product is scaled row-wise on
both sides inside the GEMM."""

from __future__ import annotations

import torch
from streamer_kernels.fp8 import FP8_MAX, fp8_linear_ref, quantize_fp8_ref


def scaled_mm_supported(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fp8_linear_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K]` bfloat16/float16 on a CUDA device with fp8; `q [N, K]` e4m3 (row-major, so `q.t()`
    is the column-major operand cuBLASLt wants); `scale [N]` float32. Shapes cuBLASLt cannot take
    (K or N not a multiple of 16) or float32 x go to the reference."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[1] % 16 or q.shape[0] % 16:
        return fp8_linear_ref(x, q, scale, bias)
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    x_scale = amax / FP8_MAX
    xq = quantize_fp8_ref(x, x_scale)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale.float()[None, :], bias=bias,
                            out_dtype=x.dtype)
