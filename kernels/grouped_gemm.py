"""Grouped matrix product of a mixture-of-experts layer: the rows of `a`, sorted by expert, each
multiplied by their expert's matrix.

`a` `[N, K]` holds the rows of expert 0, then expert 1, ...: expert e owns rows
`offs[e-1]:offs[e]` (`offs` `[E]` int32, the running sum of each expert's row count, so an expert
with no rows is an empty segment); `b` `[E, K, M]`. Returns `[N, M]`.
"""

from __future__ import annotations

from functools import cache

import torch
from streamer_kernels.cpu_extension import load


def grouped_mm_ref(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The definition: one product per expert over its segment of rows (a loop over experts,
    never over tokens)."""
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b[e], out=out[start:end])
        start = end
    return out


@cache
def _native(dtype: torch.dtype, device_type: str) -> bool:
    """Whether this torch runs `torch._grouped_mm` for `dtype` on this device kind (its CPU build
    takes float32 and bfloat16; its CUDA one needs particular GPUs, shapes and dtypes, so CUDA
    takes the reference)."""
    if device_type != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    a, b = torch.ones(2, 4, dtype=dtype), torch.ones(2, 4, 8, dtype=dtype)
    try:
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool((out == 4).all())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """As `grouped_mm_ref` (`b` may be a transposed view of `[E, M, K]` weights): on the CPU the
    compiled kernel (csrc/grouped_gemm_cpu.cpp: experts spread over the threads, 1.6-1.8x torch's
    grouped product at decode sizes, bench/moe_experts.py), else torch's grouped product where this
    torch has it for the dtype and device, else the reference."""
    if a.device.type == "cpu" and (built := load()) is not None:
        return built.grouped_mm_rows(a, b, offs)
    if _native(a.dtype, a.device.type):
        return torch._grouped_mm(a, b, offs=offs)
    return grouped_mm_ref(a, b, offs)
