"""Triton SiLU-and-multiply and GELU(tanh)-and-multiply; defined by
`streamer_kernels.activation.silu_and_mul_ref` and `gelu_tanh_and_mul_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from streamer_kernels.triton_utils import cast_rtne, next_pow2


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # The activation is rounded to the storage dtype before the product, as the reference's two torch ops.
    if GELU_TANH:
        # 0.5 g (1 + tanh(y)) = g (1 - 1 / (e^(2y) + 1)), y = sqrt(2/pi) (g + 0.044715 g^3)
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * (1.0 - 1.0 / (tl.exp(2.0 * y) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = cast_rtne(act, dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast_rtne(act * up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[..., 2I]` (gate then up) -> `silu(gate) * up` `[..., I]`, like `silu_and_mul_ref`."""
    return _act_and_mul(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[..., 2I]` (gate then up) -> `gelu_tanh(gate) * up` `[..., I]`, like `gelu_tanh_and_mul_ref`."""
    return _act_and_mul(x, out, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    block = min(1024, next_pow2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, GELU_TANH=gelu_tanh,
                              num_warps=max(1, min(8, block // 128)))
    return out
