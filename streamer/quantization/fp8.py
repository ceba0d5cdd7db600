"""fp8 (e4m3) weights with one scale per output channel (kernels/fp8.py defines them). On GPUs with
fp8 tensor cores the product is `torch._scaled_mm` on fp8 operands (kernels/fp8_gemm_cuda.py); on
the CPU and older GPUs, the reference: the weight dequantized at each call, then a dense GEMM
(correct, half of bfloat16's memory at rest, and slower: the CPU has no fp8 arithmetic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from streamer_kernels.fp8 import dequantize_fp8_ref, quantize_weight_fp8_ref
from streamer_kernels.fp8_gemm_cuda import fp8_linear_scaled_mm, scaled_mm_supported


class Fp8Weight:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.out_features, self.in_features = q.shape
        self.weight = q.contiguous()
        self.scale = scale.float().contiguous()
        self.scaled_mm = scaled_mm_supported(q.device)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Fp8Weight:
        return cls(*quantize_weight_fp8_ref(weight))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_ref(self.weight, self.scale[:, None], dtype)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.scaled_mm:
            out = fp8_linear_scaled_mm(rows, self.weight, self.scale, bias)
        else:
            out = F.linear(rows, self.dequantized(rows.dtype), bias)
        return out.view(*x.shape[:-1], self.out_features)
