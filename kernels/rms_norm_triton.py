"""Triton RMSNorm fused with the residual add; defined by `streamer_kernels.rms_norm.rms_norm_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from streamer_kernels.triton_utils import cast_rtne, next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     x_stride, res_stride, out_stride, res_out_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: a row is a hidden vector, which fits one tile for any Llama size.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the input dtype before the statistics, as the reference does.
        s = cast_rtne(x + r, x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # Normalised in float32, rounded to the input dtype, then scaled (Hugging Face's order).
    normed = cast_rtne(x * rstd, x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast_rtne(w * normed, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_ref`; `out`/`residual_out` may be given (else allocated).

    Inputs are not modified: the summed residual goes to a new tensor, like the reference.
    """
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    res2 = res_out2 = x2  # unused placeholders when there is no residual
    if residual is not None:
        res2 = residual.reshape(-1, hidden).contiguous()
        if residual_out is None:
            residual_out = torch.empty_like(x)
        res_out2 = residual_out.view(-1, hidden)
    block = next_pow2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, res_out2, hidden, eps,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual_out)
