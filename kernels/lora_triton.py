"""Triton multi-LoRA product (BGMV-style: each program one row and a tile of output columns, the
row's adapter looked up from its slot); defined by `streamer_kernels.lora.lora_delta_ref`.

Every row of a mixed batch is handled in the same launch whatever its adapter, so a step holds any
mix of adapters and base rows (slot -1: the program returns at once)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from streamer_kernels.triton_utils import next_pow2


@triton.jit
def _lora_kernel(x_ptr, slots_ptr, a_ptr, b_ptr, y_ptr, n_in, n_out,
                 x_stride, y_stride, a_slot_stride, a_rank_stride, b_slot_stride, b_out_stride,
                 RANK: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_OUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    ranks = tl.arange(0, RANK)
    # Shrink: t = x[row] @ a[slot].T, accumulated over the input in tiles (float32). Each output
    # tile recomputes it: it is RANK x n_in, small against the expand's n_out x RANK per row.
    t = tl.zeros((RANK,), dtype=tl.float32)
    for start in range(0, n_in, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        in_mask = cols < n_in
        xv = tl.load(x_ptr + row * x_stride + cols, mask=in_mask, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * a_slot_stride + ranks[:, None] * a_rank_stride + cols[None, :],
                     mask=in_mask[None, :], other=0.0).to(tl.float32)
        t += tl.sum(av * xv[None, :], axis=1)
    # Expand: y[row, tile] += b[slot][tile] @ t.
    outs = tile * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = outs < n_out
    bv = tl.load(b_ptr + slot * b_slot_stride + outs[:, None] * b_out_stride + ranks[None, :],
                 mask=out_mask[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(bv * t[None, :], axis=1)
    yv = tl.load(y_ptr + row * y_stride + outs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + outs, (yv + delta).to(y_ptr.dtype.element_ty), mask=out_mask)


def lora_add(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor
             ) -> torch.Tensor:
    """`y += lora_delta_ref(x, slots, a, b)` in place; `a` [S, R, in], `b` [S, out, R] with R a power
    of two (the engine's stacks are allocated so), `slots` int [N]."""
    n, n_in = x.shape
    n_out, rank = b.shape[1], b.shape[2]
    assert rank == next_pow2(rank) and a.shape[1] == rank, "the stacks' rank must be a power of two"
    if n == 0:
        return y
    x = x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    block_out = min(64, next_pow2(n_out))
    grid = (n, triton.cdiv(n_out, block_out))
    _lora_kernel[grid](x, slots.contiguous(), a, b, y, n_in, n_out, x.stride(0), y.stride(0),
                       a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                       RANK=rank, BLOCK_IN=min(128, next_pow2(n_in)), BLOCK_OUT=block_out)
    return y
