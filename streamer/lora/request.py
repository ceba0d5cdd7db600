"""What a request names to run under an adapter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and the folder of its PEFT files (adapter_config.json,
    adapter_model.safetensors). The name is the adapter's identity in the engine: its slot, the
    prefix cache's keys; the path says where to read it the first time it is used."""

    name: str
    path: str

    def cache_key(self) -> bytes:
        """What seeds the prefix cache's hash chain for this adapter's sequences: the same tokens under
        two adapters (or one name re-registered at another path) never share KV."""
        return f"lora\0{self.name}\0{self.path}".encode()
