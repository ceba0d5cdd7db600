"""Weight-only int8 with one scale per output channel (kernels/int8_gemm.py defines it).

On the CPU the weight is kept only in the kernel's packed layout: inputs of up to
`KERNEL_MAX_ROWS` rows (decode batches, short prefill chunks) run the VNNI kernel, which reads half
of bfloat16's bytes; larger ones dequantize the weight for the call and run a dense GEMM, except
bfloat16 rows on a CPU with AMX, which the kernel runs on the tile unit up to `TILE_UNIT_MAX_ROWS`
(it widens the weights a group of channels at a time, in cache, instead of the whole weight per call). On a GPU
it is the reference (dequantize, then GEMM): correct, and a memory saving, not a speed-up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from streamer_kernels.cpu_extension import load
from streamer_kernels.int8_gemm import dequantize_int8_ref, pack_int8_weight, quantize_int8_ref, unpack_int8_weight
from streamer_kernels.int8_gemm_cpu import int8_linear_cpu, int8_linear_tile_unit

# Rows above which the CPU dequantizes instead. Measured on the built-in model's projections (one
# thread): the kernel costs ~9 us per row, dequantizing + oneDNN's GEMM 2-5 ms per call nearly whatever
# the rows, even at 256 rows (2.1-3.9 ms against 2.3-4.5), ahead from 512 (bench/results/quantization.md).
KERNEL_MAX_ROWS = 256
# The same on the tile unit (AMX, bfloat16 rows): the kernel measured ahead of dequantizing + oneDNN up to
# 512 rows (0.4-0.7x its time) and behind at 2,048 (1.8x), per projection of the built-in model.
TILE_UNIT_MAX_ROWS = 1024
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Int8Weight:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """`q [out, in]` int8, `scale [out]` (float32 kept: the kernel scales in float32)."""
        self.out_features, self.in_features = q.shape
        self.scale = scale.float().contiguous()
        self.use_kernel = q.device.type == "cpu" and load() is not None
        # The kernel's layout only, on the CPU: a second copy would cost the memory int8 saves.
        self.weight = pack_int8_weight(q) if self.use_kernel else q.contiguous()

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int8Weight:
        return cls(*quantize_int8_ref(weight))

    def int8(self) -> torch.Tensor:
        """`q [out, in]` in row-major order."""
        if self.use_kernel:
            return unpack_int8_weight(self.weight, self.out_features, self.in_features)
        return self.weight

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8_ref(self.int8(), self.scale).to(dtype)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if (self.use_kernel and rows.dtype in _KERNEL_DTYPES and rows.stride(-1) == 1
                and (rows.shape[0] <= KERNEL_MAX_ROWS
                     or (rows.shape[0] <= TILE_UNIT_MAX_ROWS and int8_linear_tile_unit(rows)))):
            out = int8_linear_cpu(rows, self.weight, self.scale, bias, self.out_features)
        else:
            out = F.linear(rows, self.dequantized(rows.dtype), bias)
        return out.view(*x.shape[:-1], self.out_features)
