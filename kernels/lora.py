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
    """The runs of consecutive rows that share an adapter slot (base rows, slot -1, left out), as
    `(slot, start, end)`. The engine lays a step's rows out grouped by adapter (streamer/step.py), so
    an adapter's rows form one run among the decodes and one among the prompt chunks. Built once per
    step and shared by every layer."""

    runs: list[tuple[int, int, int]]

    @classmethod
    def from_slots(cls, slots: torch.Tensor) -> Segments:
        values, counts = torch.unique_consecutive(slots.cpu(), return_counts=True)
        runs, start = [], 0
        for slot, count in zip(values.tolist(), counts.tolist()):
            if slot >= 0:
                runs.append((slot, start, start + count))
            start += count
        return cls(runs)

    @property
    def empty(self) -> bool:
        return not self.runs


def lora_add_segmented(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       seg: Segments) -> torch.Tensor:
    """`y + delta` for the batch's adapter rows, in place on `y`: per run of rows of one adapter, one
    shrink GEMM and one expand GEMM added into `y`'s rows where they are. No gather or scatter: on the
    CPU an indexed add of the adapter rows back into `y` measured more than all the products together
    (bfloat16 `index_add_` is a scalar loop), and the products are tiny, so what counts is the ops."""
    for slot, start, end in seg.runs:
        y[start:end].addmm_(torch.mm(x[start:end], a[slot].T), b[slot].T)
    return y
