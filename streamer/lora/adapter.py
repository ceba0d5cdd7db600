"""Reads a PEFT LoRA adapter and lays its weights out for the engine's fused projections.

The engine fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; PEFT keeps them apart. An
adapter's per-projection A `[r, in]` and B `[out, r]` become, per fused module, one A of
`parts x R` rows and one B with each part's columns in its own block (zeros elsewhere): one shrink
and one expand GEMM per module however many of its parts the adapter targets."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# PEFT's target module name -> (the engine's module, the part of its output it covers).
PARTS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    # Phi-3's checkpoints (and adapters trained on them) have the fused modules themselves.
    "qkv_proj": ("qkv_proj", -1), "gate_up_proj": ("gate_up_proj", -1),
}
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
NUM_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter the engine cannot serve (a request naming it is refused as invalid)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights: `weights[(layer, module, part)] = (A [r, in], B [out_part, r] scaled)`,
    part -1 covering the fused module's whole output."""

    name: str
    rank: int
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter at {path}: no adapter_config.json (a PEFT adapter folder is expected)")
    return json.loads(config_file.read_text())


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter (AdapterError on anything the engine cannot apply exactly)."""
    path = Path(path)
    cfg = read_config(path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = int(cfg["r"])
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out") if cfg.get(k)]
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save") or unsupported:
        raise AdapterError(f"LoRA adapter {name!r}: only plain LoRA on the projections is served "
                           f"(no bias, modules_to_save, DoRA or fan_in_fan_out)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"LoRA adapter {name!r}: per-module rank_pattern/alpha_pattern is not supported")
    alpha = float(cfg.get("lora_alpha", rank))
    # rsLoRA scales by alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora).
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"LoRA adapter at {path}: no adapter_model.safetensors")
    tensors = load_file(str(weights_file))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PARTS:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key} targets a module the engine does not "
                               f"adapt (supported: {', '.join(PARTS)})")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    weights = {}
    for (layer, target), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
        module, part = PARTS[target]
        weights[(layer, module, part)] = (ab["A"].float(), ab["B"].float() * scaling)
    return LoRAAdapter(name, rank, weights)
