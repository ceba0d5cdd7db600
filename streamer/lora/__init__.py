"""Multi-LoRA serving: PEFT adapters loaded into a bounded set of slots and applied to mixed batches
(docs/lora.md)."""

from streamer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
