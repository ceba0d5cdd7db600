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


def lora_add_segmented(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                       seg: Segments) -> torch.Tensor:
    """`y + delta` for the batch's adapter rows, in place on `y`, with the stacks laid out for plain
    row-major products, `a_t [S, in, R]` and `b_t [S, R, out]`, in float32: per run of rows of one
    adapter, one shrink and one expand GEMM added into `y`'s rows where they are. No gather or scatter
    (a bfloat16 `index_add_` of the adapter rows measured more than all the products together), and the
    products in float32: at these sizes (16 rows x 576 x 48) torch's bfloat16 GEMM on the CPU measured
    ~10x slower than float32 (and a transposed operand ~10x slower again)."""
    if seg.empty:
        return y
    xf = x if x.dtype == a_t.dtype else x.to(a_t.dtype)
    for slot, start, end in seg.runs:
        rows = y[start:end]
        if rows.dtype == a_t.dtype:
            rows.addmm_(torch.mm(xf[start:end], a_t[slot]), b_t[slot])
        else:
            rows.add_(torch.mm(torch.mm(xf[start:end], a_t[slot]), b_t[slot]))
    return y
