"""LoRA adapters as OpenAI model names, the way vLLM shows them: each registered adapter is a model of
its own in `/v1/models` (`id` its name, `root` its path, `parent` the base model), and a request names
it either alone (`"model": "ADAPTER"`) or with its base (`"model": "BASE:ADAPTER"`)."""

from __future__ import annotations

from typing import Any

from clients.loras import LoraEntry


def adapter_models(entries: list[LoraEntry], bases: list[str], created: int) -> list[dict[str, Any]]:
    parent = bases[0] if len(bases) == 1 else None  # several base models: an adapter's base is not known here
    return [{"id": e.name, "object": "model", "created": created, "owned_by": "streamer", "root": e.path,
             "parent": parent} for e in entries]


def split_model(model: str, bases: set[str]) -> tuple[str, str | None]:
    """(the base model's name, the adapter's name or None) of a request's `model`. `BASE:ADAPTER` splits
    at the last ':' whose left side is a served base (base names may hold ':' themselves); anything else
    is a base model or an adapter named alone (the caller looks it up)."""
    if model in bases:
        return model, None
    base, sep, adapter = model.rpartition(":")
    if sep and base in bases and adapter:
        return base, adapter
    return model, model if ":" not in model else None
