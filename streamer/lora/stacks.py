"""One projection's adapter weights, stacked by slot, and the forward hook that adds their product.

The hook is registered on the engine's linear modules only once an adapter is first used, so a
worker that never serves one runs its layers exactly as without LoRA."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from streamer_kernels.lora import cpu_stack_dtype
from torch import nn

from streamer.lora.adapter import NUM_PARTS, AdapterError

if TYPE_CHECKING:
    from streamer.lora.batch import LoRABatch


@dataclass(frozen=True)
class ModuleShape:
    sizes: list[int]  # the output widths of the fused module's parts (q, k, v; gate, up; or the whole)
    in_features: int
    dtype: torch.dtype
    device: torch.device


def module_shape(module: nn.Module, name: str) -> ModuleShape:
    weight = module.weight
    if name == "qkv_proj":
        sizes = [module.num_heads * module.head_size] + [module.num_kv_heads * module.head_size] * 2
    elif name == "gate_up_proj":
        sizes = [s // module.tp_size for s in module.output_sizes]
    else:
        sizes = [weight.shape[0]]
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.get_default_dtype()
    return ModuleShape(sizes, weight.shape[1], dtype, weight.device)


class LoRAStack:
    """`a [S, P*R, in]`, `b [S, out, P*R]` for S slots, P parts and the stack rank R (the largest rank
    served, rounded up to a power of two for the GPU kernel). Part p of an adapter occupies rows
    `p*R : p*R + r` of A and, in B, its output rows and the same columns: one shrink and one expand
    product serve all the parts, the other blocks being zero."""

    def __init__(self, module: nn.Module, name: str, shape: ModuleShape, num_slots: int, rank: int,
                 batch: LoRABatch) -> None:
        self.name = name
        self.sizes = shape.sizes
        self.rank = rank
        self.in_features = shape.in_features
        out = sum(self.sizes)
        parts = NUM_PARTS[name]
        # (a quantized weight's adapter runs in the default dtype: the activations')
        dtype, device = shape.dtype, shape.device
        # On the CPU the stacks are transposed for plain row-major products, float32 or bfloat16
        # (kernels/lora.py: cpu_stack_dtype says when); the Triton kernel reads them as
        # A [S, R, in], B [S, out, R] in the model's dtype.
        self.cpu = device.type == "cpu"
        if self.cpu:
            stack_dtype = cpu_stack_dtype(dtype)
            self.a = torch.zeros(num_slots, self.in_features, parts * rank, dtype=stack_dtype)
            self.b = torch.zeros(num_slots, parts * rank, out, dtype=stack_dtype)
        else:
            self.a = torch.zeros(num_slots, parts * rank, self.in_features, dtype=dtype, device=device)
            self.b = torch.zeros(num_slots, out, parts * rank, dtype=dtype, device=device)
        # For the CPU kernel (kernels/lora.py: lora_add_cpu): the rank columns [lo, hi) each part of
        # a slot reads (empty where the adapter leaves the part out), and each part's output columns.
        self.spans = torch.zeros(num_slots, parts, 2, dtype=torch.int64)
        self.part_cols = torch.tensor([0, *itertools.accumulate(self.sizes)], dtype=torch.int64)
        self.batch = batch
        self.handle = module.register_forward_hook(self._hook)

    def check(self, part: int, a: torch.Tensor, b: torch.Tensor, adapter: str, layer: int) -> None:
        want_out = sum(self.sizes) if part < 0 else self.sizes[part]
        if a.shape[1] != self.in_features or b.shape[0] != want_out:
            raise AdapterError(f"LoRA adapter {adapter!r}: layer {layer} {self.name} part {part} has shapes "
                               f"A {tuple(a.shape)}, B {tuple(b.shape)}, the model needs A [r, {self.in_features}] "
                               f"and B [{want_out}, r] (an adapter of another base model?)")

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's parts of this module into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.spans[slot].zero_()
        starts = [sum(self.sizes[:p]) for p in range(len(self.sizes))]
        for part, (a, b) in parts.items():
            block = max(part, 0) * self.rank
            r = a.shape[0]
            rows = slice(None) if part < 0 else slice(starts[part], starts[part] + self.sizes[part])
            # (an adapter of the fused module as a whole: every part reads the same columns)
            self.spans[slot, slice(None) if part < 0 else part] = torch.tensor([block, block + r])
            if self.cpu:
                self.a[slot, :, block:block + r] = a.T.to(self.a.dtype)
                self.b[slot, block:block + r, rows] = b.T.to(self.b.dtype)
            else:
                self.a[slot, block:block + r] = a.to(self.a.dtype)
                self.b[slot, rows, block:block + r] = b.to(self.b.dtype)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return self.batch.apply(args[0], output, self.a, self.b, self.spans, self.part_cols)
