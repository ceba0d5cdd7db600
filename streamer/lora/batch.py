"""Which rows of the step run under which adapter slot, as every layer's LoRA hook reads it."""

from __future__ import annotations

import torch
from streamer_kernels.lora import Segments, lora_add_cpu


class LoRABatch:
    """Set once per step (`set`), read by every hook (`apply`), cleared after the forward. A layer
    sees either every token of the step or, past the last layer's K/V, only the sample rows
    (models/llama.py): the number of rows it is handed says which. On the GPU the Triton kernel
    takes the per-row slots; on the CPU the rows are grouped by slot once per step (`Segments`)."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton
        self.active = False
        self._by_rows: dict[int, tuple[torch.Tensor, Segments | None]] = {}

    def set(self, token_slots: torch.Tensor, sample_rows: torch.Tensor) -> None:
        groups = [token_slots]
        if sample_rows.numel() != token_slots.numel():
            groups.append(token_slots[sample_rows])
        self._by_rows = {len(s): (s, None if self.use_triton else Segments.from_slots(s)) for s in groups}
        self.active = True

    def clear(self) -> None:
        self.active = False
        self._by_rows = {}

    def apply(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, spans: torch.Tensor,
              part_cols: torch.Tensor) -> torch.Tensor:
        """`y` plus the adapters' products for `x`'s rows; `spans`, `part_cols` (the CPU kernel's
        hints, kernels/lora.py: lora_add_cpu) are unused on the GPU."""
        if not self.active:
            return y
        slots, segments = self._by_rows[x.shape[0]]
        if segments is None:
            from streamer_kernels.lora_triton import lora_add

            return lora_add(x.reshape(-1, x.shape[-1]), y, slots, a, b)
        return lora_add_cpu(x, y, a, b, segments, spans, part_cols)
