"""Multi-LoRA products over a mixed batch (Punica's SGMV, S-LoRA): rows of several adapters and
base-model rows in one call. Each adapter lives in a slot of stacked weights: `a[slot]` is its
down-projection `[R, in]`, `b[slot]` its up-projection `[out, R]` with the scaling folded in
(zero-padded past the adapter's own rank). A row's slot -1 means the base model: no delta.

`lora_delta_ref` defines the result; `lora_add_segmented` is the CPU path the engine runs (and
what the Triton kernel in lora_triton.py is checked against with it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lora_delta_ref(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition: row i gets `(x[i] @ a[s].T) @ b[s].T` for its slot s, or zeros for s = -1.
    Computed row by row in float32."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] = (x[i].float() @ a[s].float().T) @ b[s].float().T
    return out


@dataclass
class Segments:
    """The rows of a batch grouped by adapter slot, padded to a block per slot: block k holds the
    rows of slot k (row ids in `index[k]`, `length` of them, the rest padding). Built once per step and
    shared by every layer, so each layer runs a fixed handful of ops whatever the number of adapters:
    one gather, two batched GEMMs over the slots, one indexed add."""

    index: torch.Tensor  # int64 [S * L]: batch row of each position of each slot's block (padding: 0)
    pad: torch.Tensor | None  # [S * L, 1] 1 for real rows, 0 for padding; None when nothing is padded
    num_slots: int  # S: the blocks, slots 0..S-1 (a slot without rows is all padding)
    length: int  # L: rows per block (the most rows any slot has)
    count: int  # rows with an adapter (0: nothing to do)

    @classmethod
    def from_slots(cls, slots: torch.Tensor, num_slots: int | None = None,
                   dtype: torch.dtype = torch.float32) -> Segments:
        slots = slots.to(torch.int64)
        present = slots >= 0
        count = int(present.sum())
        num_slots = num_slots or (int(slots.max()) + 1 if count else 0)
        if count == 0:
            return cls(torch.zeros(0, dtype=torch.int64), None, 0, 0, 0)
        rows = torch.nonzero(present).flatten()
        order = torch.argsort(slots[rows], stable=True)  # stable: each slot's rows in batch order
        rows, by_slot = rows[order], slots[rows][order]
        per_slot = torch.bincount(by_slot, minlength=num_slots)
        length = int(per_slot.max())
        starts = torch.cumsum(per_slot, 0) - per_slot
        position = by_slot * length + (torch.arange(count) - starts[by_slot])
        index = torch.zeros(num_slots * length, dtype=torch.int64)
        index[position] = rows
        pad = None
        if count < num_slots * length:
            pad = torch.zeros(num_slots * length, 1, dtype=dtype)  # in the activations' dtype: no cast per layer
            pad[position] = 1.0
        return cls(index, pad, num_slots, length, count)

    @property
    def empty(self) -> bool:
        return self.count == 0


def lora_add_segmented(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                       seg: Segments) -> torch.Tensor:
    """`y + delta` for the batch's adapter rows, in place on `y`, with `a_t [S, in, R]` and
    `b_t [S, R, out]` (the stacks transposed for the batched products): the rows gathered into one
    block per slot, one shrink and one expand `bmm` over all the blocks, and one indexed add back.
    Padding positions gather row 0 and are zeroed before the products, so what they add is zero.
    Five ops per module whatever the number of adapters (each one a tiny product on the CPU, where the
    cost of an op, not its arithmetic, dominates)."""
    if seg.empty:
        return y
    xs = x.index_select(0, seg.index)
    if seg.pad is not None:
        xs.mul_(seg.pad)
    s, length = seg.num_slots, seg.length
    t = torch.bmm(xs.view(s, length, -1), a_t[:s])
    delta = torch.bmm(t, b_t[:s])
    y.index_add_(0, seg.index, delta.view(s * length, -1))
    return y
