"""The adapters a model runner serves: read on first use (and checked against the model), kept in a
bounded set of slots on the device with the least recently used evicted, and applied to each step's
rows through the linear modules' hooks."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from streamer.lora.adapter import MODULES, AdapterError, LoRAAdapter, load_adapter
from streamer.lora.batch import LoRABatch
from streamer.lora.request import LoRARequest
from streamer.lora.stacks import LoRAStack, module_shape


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, device: torch.device,
                 max_cpu_loras: int | None = None) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = device
        # Read adapters kept in host memory (a slot evicted and wanted again is copied, not re-read).
        self.max_cpu_loras = max_cpu_loras or 2 * max_loras
        self.slots: OrderedDict[LoRARequest, int] = OrderedDict()  # least recently used first
        self.read: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        self.stacks: dict[tuple[int, str], LoRAStack] | None = None  # built on the first adapter used
        # The adapted modules and their shapes, taken now: CPU weight packing drops the dense weights.
        self.modules = [(i, name, module, module_shape(module, name))
                        for i, layer in enumerate(model.layers) for owner in (layer.self_attn, layer.mlp)
                        for name in MODULES if isinstance(module := getattr(owner, name, None), nn.Module)
                        and hasattr(module, "weight")]
        self.batch = LoRABatch(use_triton=device.type == "cuda")
        self.num_loads = 0  # adapters copied into a slot (each eviction makes one more)

    # ---- adapters --------------------------------------------------------------------------------
    def check(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter read and checked (AdapterError / ValueError if it cannot be served)."""
        adapter = self.read.get(lora)
        if adapter is not None:
            self.read.move_to_end(lora)
            return adapter
        try:
            adapter = load_adapter(lora.name, lora.path, self.max_lora_rank)
        except (OSError, KeyError, ValueError) as e:
            raise AdapterError(str(e) if isinstance(e, AdapterError) else
                               f"LoRA adapter {lora.name!r} at {lora.path}: cannot be read ({e})") from e
        stacks = self._stacks()
        for (layer, module, part), (a, b) in adapter.weights.items():
            stack = stacks.get((layer, module))
            if stack is None:
                raise AdapterError(f"LoRA adapter {lora.name!r}: layer {layer} {module} is not in this model")
            stack.check(part, a, b, lora.name, layer)
        self.read[lora] = adapter
        while len(self.read) > self.max_cpu_loras:
            self.read.popitem(last=False)
        return adapter

    def loaded(self) -> list[str]:
        """The adapters in slots now, most recently used last (workers advertise them for routing)."""
        return [lora.name for lora in self.slots]

    def _stacks(self) -> dict[tuple[int, str], LoRAStack]:
        if self.stacks is None:
            rank = _pow2(self.max_lora_rank)
            self.stacks = {(i, name): LoRAStack(module, name, shape, self.max_loras, rank, self.batch)
                           for i, name, module, shape in self.modules}
        return self.stacks

    def _slot_for(self, lora: LoRARequest, needed: set[LoRARequest]) -> int:
        slot = self.slots.get(lora)
        if slot is not None:
            self.slots.move_to_end(lora)
            return slot
        if len(self.slots) < self.max_loras:
            slot = len(self.slots)
        else:
            victim = next((v for v in self.slots if v not in needed), None)
            if victim is None:  # the scheduler admits at most max_loras adapters at once
                raise RuntimeError(f"more than {self.max_loras} adapters in one step")
            slot = self.slots.pop(victim)
        adapter = self.check(lora)
        by_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module, part), ab in adapter.weights.items():
            by_module.setdefault((layer, module), {})[part] = ab
        for key, stack in self._stacks().items():
            stack.load(slot, by_module.get(key, {}))
        self.slots[lora] = slot
        self.num_loads += 1
        return slot

    # ---- steps -------------------------------------------------------------------------------------
    def begin_step(self, row_loras: list[tuple[LoRARequest | None, int]], sample_rows: torch.Tensor) -> bool:
        """Point the hooks at this step's rows (`row_loras`: each attention row's adapter and token
        count, in the flat step's order). False, and nothing set, when no row has an adapter."""
        needed = {lora for lora, _ in row_loras if lora is not None}
        if not needed:
            return False
        slot_of = {lora: self._slot_for(lora, needed) for lora in needed}
        slots = [-1 if lora is None else slot_of[lora] for lora, _ in row_loras]
        counts = [n for _, n in row_loras]
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32), torch.tensor(counts))
        token_slots = token_slots.to(self.device)
        self.batch.set(token_slots, sample_rows)
        return True

    def end_step(self) -> None:
        self.batch.clear()
