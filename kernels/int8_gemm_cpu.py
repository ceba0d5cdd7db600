"""Weight-only int8 linear layer on the CPU (csrc/int8_gemm_cpu.cpp, AVX-512 VNNI), defined by
`int8_linear_ref` in int8_gemm.py; the weight in `pack_int8_weight`'s layout. x is rounded to int16
per row inside (int8_gemm.py: int8_linear_kernel_arith_ref is its arithmetic exactly), except where
`int8_linear_tile_unit(x)`: bfloat16 x of 16 rows or more on a CPU with AMX is multiplied as it is,
on the tile unit, against the weights widened to bfloat16 (int8_linear_ref's arithmetic)."""

from __future__ import annotations

import torch
from streamer_kernels.cpu_extension import module


def int8_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
    """`x [M, K]` float32 or bfloat16 (rows contiguous) -> `[M, out_features]` in x's dtype."""
    return module().int8_linear(x, packed, scale, bias, out_features)


def int8_linear_tile_unit(x: torch.Tensor) -> bool:
    """Whether `int8_linear_cpu` runs this x on the CPU's tile unit (AMX) rather than rounding it to int16."""
    return module().int8_linear_tile_unit(x)
