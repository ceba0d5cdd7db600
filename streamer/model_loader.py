"""Loading weights from safetensors files (single or sharded) through each parameter's loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {root}")
    return files


def _replicated_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Parameters every rank holds whole (norm weights)."""
    param.data.copy_(loaded[:])


def has_tensor(root: Path, name: str) -> bool:
    """Whether the checkpoint stores a tensor of that name (read from the index or the files' headers)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return name in json.loads(index.read_text())["weight_map"]
    for file in checkpoint_files(root):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                return True
    return False


def load_weights(model: nn.Module, root: Path, skipped_suffixes: tuple[str, ...] = (),
                 optional: tuple[str, ...] = ()) -> None:
    """Copy every checkpoint tensor into its parameter. Tensors are read lazily as slices so each
    tensor-parallel rank reads only its own shard from disk. Names ending in `skipped_suffixes`
    are not read (a quantized checkpoint's zero points, streamer/quantization/compressed_tensors.py);
    parameters named in `optional` may be missing (an embedding checkpoint's LM head)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in checkpoint_files(root):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if skipped_suffixes and name.endswith(skipped_suffixes):
                    continue
                target = model.checkpoint_name_to_param(name)
                if target is None:
                    continue
                param_name, shard_id = target
                if param_name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({param_name})")
                param = params[param_name]
                loader = getattr(param, "weight_loader", _replicated_loader)
                with torch.no_grad():
                    loader(param, f.get_slice(name), shard_id)
                loaded.add(param_name)
    missing = set(params) - loaded - set(optional)
    if missing:
        raise KeyError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")
