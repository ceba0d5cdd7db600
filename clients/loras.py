"""The LoRA adapter registry in Redis: name -> where every worker reads the adapter's PEFT files.

Operators write it (`streamer lora add|remove`); workers read an entry for each job naming an adapter,
and gateways list the names as OpenAI models. It lives in Redis, not in a worker, so every worker knows
every adapter and a restarted worker serves the same ones (docs/lora.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from clients.names import Names
from clients.protocol import LORA_NAME_RE


@dataclass(frozen=True)
class LoraEntry:
    name: str
    path: str


def check_name(name: str) -> None:
    if not LORA_NAME_RE.match(name):
        raise ValueError(f"LoRA adapter name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-' "
                         "(it is also an OpenAI model name; ':' separates base and adapter there)")


def encode_entry(path: str) -> str:
    return json.dumps({"path": path})


def decode_entry(name: Any, value: Any) -> LoraEntry | None:
    """An entry as Redis returned it, or None when it is not one (a hand-written value)."""
    text = lambda v: v.decode(errors="replace") if isinstance(v, bytes) else str(v)  # noqa: E731
    try:
        path = json.loads(text(value))["path"]
    except (ValueError, KeyError, TypeError):
        return None
    return LoraEntry(text(name), path) if isinstance(path, str) else None


async def lookup(redis: Any, names: Names, name: str) -> LoraEntry | None:
    """The registered adapter of this name (None: not registered)."""
    return decode_entry(name, await redis.hget(names.loras, name)) if LORA_NAME_RE.match(name) else None


async def list_all(redis: Any, names: Names) -> list[LoraEntry]:
    raw = await redis.hgetall(names.loras)
    entries = (decode_entry(k, v) for k, v in raw.items())
    return sorted((e for e in entries if e is not None), key=lambda e: e.name)
