"""Grouped matrix product of a mixture-of-experts layer: the rows of `a`, sorted by expert, each
multiplied by their expert's matrix.

`a` `[N, K]` holds the rows of expert 0, then expert 1, ...: expert e owns rows
`offs[e-1]:offs[e]` (`offs` `[E]` int32, the running sum of each expert's row count, so an expert
with no rows is an empty segment); `b` `[E, K, M]`. Returns `[N, M]`.

And the experts' whole MLP in one call (`moe_experts`, defined by `moe_experts_ref`): gate/up,
SiLU-and-multiply and down for every expert's rows, over weights packed once at load
(`pack_experts`); `moe_layer` (defined by `moe_layer_ref`) adds the sort by expert before and the
weighted sum of each token's experts after. On the CPU, the compiled kernel
(csrc/grouped_gemm_cpu.cpp).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from streamer_kernels.activation import silu_and_mul_ref
from streamer_kernels.cpu_extension import load

# Packed column blocks: gate/up in blocks of 32 gate and the same 32 up columns (one 64-column
# product whose halves the activation pairs), down in blocks of 64; the hidden size (gate/up's
# reduction) padded to 32 with zeros, whole AMX tile rows of bfloat16 pairs.
UP_BLOCK, DOWN_BLOCK, K_ALIGN = 32, 64, 32


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


def moe_experts_ref(a: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The definition: `a` `[N, H]` rows sorted by expert as for `grouped_mm_ref`, `w13`
    `[E, 2I, H]` (each expert's gate rows, then its up rows), `w2` `[E, H, I]`; each row through its
    expert's `down(silu(gate(a)) * up(a))`, each product rounded to the dtype. Returns `[N, H]`."""
    h = silu_and_mul_ref(grouped_mm_ref(a, w13.transpose(1, 2), offs))
    return grouped_mm_ref(h, w2.transpose(1, 2), offs)


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, rows, offs) of a step's (token, choice) pairs, `experts` `[T, k]` each token's expert
    ids: `order` the pairs' flat indices grouped by expert (stable: tokens in order within an
    expert), `rows` their tokens, `offs` `[E]` int32 the running counts, as `grouped_mm` takes them."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    return order, order // experts.shape[1], offs


def moe_layer_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """The definition of a layer's experts from the router's choices (`weights`, `experts` `[T, k]`):
    each token's sum over its choices of weight * its expert's output (`moe_experts_ref`), the
    weighted rows rounded to x's dtype, added in expert order (`index_add_`: in float32 for
    bfloat16, rounded once)."""
    order, rows, offs = sort_by_expert(experts, w13.shape[0])
    y = moe_experts_ref(x[rows], offs, w13, w2)
    y = (y * weights.flatten()[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


def moe_experts_packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `moe_experts` runs packed weights of this dtype here (the CPU kernel: float32, and
    bfloat16 where this CPU and torch run oneDNN's bfloat16 micro-kernels, AVX-512 or AMX)."""
    return device.type == "cpu" and (built := load()) is not None and built.moe_experts_runs(dtype)


def _blocks_as_columns(blocks: torch.Tensor) -> torch.Tensor:
    """`[E, NB, n, k]` (each block's output rows, as stored) to each block's right operand `[k, n]`,
    bfloat16 as pairs along k (`[k/2, n, 2]`, the micro-kernels' VNNI layout) flattened to `[k/2, 2n]`."""
    e, nb, n, k = blocks.shape
    if blocks.dtype == torch.bfloat16:
        return blocks.view(e, nb, n, k // 2, 2).permute(0, 1, 3, 2, 4).reshape(e, nb, k // 2, 2 * n).contiguous()
    return blocks.transpose(2, 3).contiguous()


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w13` `[E, 2I, H]` and `w2` `[E, H, I]` in `moe_experts`' layout (csrc/grouped_gemm_cpu.cpp):
    w13 `[E, NB1, Hp, 2 UP_BLOCK]`, block j holding gate columns `j UP_BLOCK..` then the same up
    columns, I padded to whole blocks and H to K_ALIGN; w2 `[E, NB2, Ip, DOWN_BLOCK]`. Padding is
    zeros: padded h columns are SiLU(0) * 0 = 0, padded output columns are never written."""
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    nb1 = -(-inter // UP_BLOCK)
    ip, hp = nb1 * UP_BLOCK, -(-hidden // K_ALIGN) * K_ALIGN
    gate = F.pad(w13[:, :inter], (0, hp - hidden, 0, ip - inter)).view(e, nb1, UP_BLOCK, hp)
    up = F.pad(w13[:, inter:], (0, hp - hidden, 0, ip - inter)).view(e, nb1, UP_BLOCK, hp)
    nb2 = -(-hidden // DOWN_BLOCK)
    down = F.pad(w2, (0, ip - inter, 0, nb2 * DOWN_BLOCK - hidden)).view(e, nb2, DOWN_BLOCK, ip)
    return _blocks_as_columns(torch.cat([gate, up], dim=2)), _blocks_as_columns(down)


def moe_experts(x: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor,
                packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`moe_experts_ref(x[rows], offs, w13, w2)` with `packed = pack_experts(w13, w2)`, in one call
    of the compiled kernel (where `moe_experts_packable`)."""
    return load().moe_experts(x.contiguous(), rows, offs, *packed)


def moe_layer(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`moe_layer_ref(x, weights, experts, w13, w2)` with `packed = pack_experts(w13, w2)`: the
    sort by expert, the experts and the weighted sum in one call of the compiled kernel."""
    return load().moe_layer(x.contiguous(), weights, experts, *packed)
