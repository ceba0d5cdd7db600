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
    """The rows of a batch grouped by adapter: `rows` lists the adapter rows sorted by slot (base
    rows left out), `bounds[k]:bounds[k+1]` of it are the rows of slot `slots[k]`. Built once per
    step and shared by every layer, so each layer only gathers, multiplies and scatters."""

    rows: torch.Tensor  # int64 [M]: indices into the batch, grouped by slot
    slots: list[int]
    bounds: list[int]

    @classmethod
    def from_slots(cls, slots: torch.Tensor) -> Segments:
        # A stable sort keeps each adapter's rows in batch order (their order does not matter to
        # the result, but a stable gather reads memory forward).
        order = torch.argsort(slots, stable=True)
        sorted_slots = slots[order]
        first = int((sorted_slots < 0).sum())
        present, counts = torch.unique_consecutive(sorted_slots[first:], return_counts=True)
        bounds = [0]
        for c in counts.tolist():
            bounds.append(bounds[-1] + c)
        return cls(order[first:], present.tolist(), bounds)

    @property
    def empty(self) -> bool:
        return not self.slots


def lora_add_segmented(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       seg: Segments) -> torch.Tensor:
    """`y + delta` for the batch's adapter rows, in place on `y`: one gather of those rows, then per
    adapter one shrink and one expand GEMM over its contiguous rows, and one indexed add back. The
    number of GEMMs is twice the number of distinct adapters in the step, not the number of rows."""
    if seg.empty:
        return y
    xs = x.index_select(0, seg.rows)
    delta = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in zip(seg.slots, seg.bounds, seg.bounds[1:]):
        torch.mm(torch.mm(xs[start:end], a[slot].T), b[slot].T, out=delta[start:end])
    y.index_add_(0, seg.rows, delta)
    return y
