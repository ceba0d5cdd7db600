"""Multi-LoRA products over a mixed batch (Punica's SGMV, S-LoRA): rows of several adapters and
base-model rows in one call. Each adapter lives in a slot of stacked weights: `a[slot]` is its
down-projection `[R, in]`, `b[slot]` its up-projection `[out, R]` with the scaling folded in
(zero-padded past the adapter's own rank). A row's slot -1 means the base model: no delta.

`lora_delta_ref` defines the result. On the CPU the engine runs `lora_add_cpu`: the compiled kernel
(csrc/lora_cpu.cpp, one call per module for every run of rows), or `lora_add_segmented`, the same
products as torch ops, where the kernels cannot be built. The Triton kernel (lora_triton.py) is
checked against the definition too."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from streamer_kernels.cpu_extension import load as cpu_kernels


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
    table: torch.Tensor = field(init=False, repr=False)  # the runs as int64 [n, 3], what the kernel reads

    def __post_init__(self) -> None:
        self.table = torch.tensor(self.runs, dtype=torch.int64).reshape(-1, 3)

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


def cpu_stack_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the CPU stacks: bfloat16 for a bfloat16 model where the compiled kernel runs (it
    widens them as it reads them: a decode step's products wait on reading the stacks, and bfloat16
    halves those bytes), else float32 (the torch ops' bfloat16 products are the slow ones)."""
    return torch.bfloat16 if model_dtype == torch.bfloat16 and cpu_kernels() is not None else torch.float32


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


def lora_add_cpu(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, seg: Segments,
                 spans: torch.Tensor, part_cols: torch.Tensor) -> torch.Tensor:
    """As `lora_add_segmented`, in one compiled call for all the runs (csrc/lora_cpu.cpp) where the
    CPU kernels are built and x, y are float32 or bfloat16. `spans [S, P, 2]` (int64): the rank
    columns `[lo, hi)` that part p of a slot reads, `part_cols [P + 1]`: the output columns each part
    writes; `b_t` must be zero outside those blocks (the stacks keep it so), which lets the kernel
    leave them out. The kernel's sums are float32, added into `y` and rounded once."""
    if seg.empty:
        return y
    if (x.dtype == y.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
            and x.stride(1) == 1 and y.stride(1) == 1 and cpu_kernels()):
        cpu_kernels().lora_add_runs(x, y, a_t, b_t, seg.table, spans, part_cols)
        return y
    return lora_add_segmented(x, y, a_t, b_t, seg)
