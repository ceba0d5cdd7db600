"""Weight-only int8 linear layers: the reference that defines them, and the weight packing.

A weight `[out, in]` is stored as int8 `q` with one float32 scale per output channel (symmetric,
`scale = max|w_row| / 127`, as compressed-tensors' and vLLM's per-channel int8), and the layer
computes `y = (x . q^T) * scale + bias` with float32 sums. The CPU kernel
(int8_gemm_cpu.py, csrc/int8_gemm_cpu.cpp) reads `q` in the packed layout of `pack_int8_weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 16  # output channels per packed block: one float32 vector of AVX-512


def quantize_int8_ref(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `(q [out, in] int8, scale [out] float32)` with
    `weight ~= q * scale[:, None]`. A row of zeros gets scale 1 (q is 0 anyway)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight the int8 one stands for."""
    return q.float() * scale.float()[:, None]


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`(x . q^T) * scale + bias` in float32, rounded once to x's dtype at the end."""
    y = F.linear(x.float(), q.float()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_int8_weight(q: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` int8 as `[ceil(N/16), ceil(K/2), 16, 2]`: each 32 bytes hold 16 output channels
    times 2 consecutive inputs (one vdpbf16ps operand); the padding is zero."""
    n, k = q.shape
    padded = F.pad(q, (0, k % 2, 0, -n % BLOCK))
    blocks, k2 = padded.shape[0] // BLOCK, padded.shape[1] // 2
    return padded.view(blocks, BLOCK, k2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_int8_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_int8_weight`."""
    blocks, k2 = packed.shape[0], packed.shape[1]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, k2 * 2)[:n, :k]


def quantize_rows_int16_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How the CPU kernel reads x: each row rounded to int16 with scale `max|row| / 32767`
    (`(q [M, K] float32 holding integers, scale [M, 1])`; an all-zero row gets scale 1)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 32767.0, torch.ones_like(amax))
    return torch.round(xf * torch.where(amax > 0, 32767.0 / amax, torch.ones_like(amax))), scale


def int8_linear_kernel_arith_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_linear_ref` with x rounded as the CPU kernel rounds it (quantize_rows_int16_ref): the
    kernel's arithmetic exactly, up to the order of float32 sums (its integer sums are exact)."""
    xq, xs = quantize_rows_int16_ref(x)
    y = F.linear(xq.double(), q.double()).float() * xs * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
