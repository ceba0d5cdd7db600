"""Reading a local Hugging Face checkpoint directory: config, dtype, limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from streamer_kernels.cpu_features import fast_bfloat16

from streamer.architectures import SUPPORTED_ARCHITECTURES, unsupported_message
from streamer.errors import ConfigError
from streamer.hf_config import load_hf_config
from streamer.layers.attention import sliding_window
from streamer.model_loader import has_tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ConfigError):
    pass


@dataclass
class ModelConfig:
    path: Path
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    # > 0: every layer attends to its last kv_window keys only, so the blocks before them can go
    kv_window: int = 0
    # False: the checkpoint has no LM head (an embedding model saved as its base model, as
    # Qwen3-Embedding): it serves embeddings only (streamer/pooling.py)
    generates: bool = True

    @classmethod
    def load(cls, path: str, dtype: str | None, device: torch.device, max_model_len: int | None) -> ModelConfig:
        root = Path(path).expanduser()
        if not (root / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {root}: --model must be a local Hugging Face "
                                    "checkpoint directory")
        hf = load_hf_config(root)
        archs = getattr(hf, "architectures", None) or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(unsupported_message(", ".join(archs) or repr(hf.model_type)))
        # The model's whole context: layers with a sliding window attend within it (the attention
        # kernels' `window`, streamer/layers/attention.py), however long the sequence.
        limit = int(hf.max_position_embeddings)
        if max_model_len is not None:
            if max_model_len > limit:
                raise ConfigError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
            limit = max_model_len
        heads = hf.num_attention_heads
        return cls(
            path=root,
            hf_config=hf,
            dtype=_resolve_dtype(dtype, hf, device),
            max_model_len=limit,
            num_layers=hf.num_hidden_layers,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_size=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            kv_window=_kv_window(hf),
            generates=bool(getattr(hf, "tie_word_embeddings", False)) or has_tensor(root, "lm_head.weight"),
        )


def _kv_window(hf: Any) -> int:
    """The window every layer keeps to (0 when some layer attends to every key: Gemma's global
    layers, Qwen2's layers before max_window_layers)."""
    windows = [sliding_window(hf, i) for i in range(hf.num_hidden_layers)]
    return max(windows) if windows and min(windows) > 0 else 0


def _resolve_dtype(name: str | None, hf: Any, device: torch.device) -> torch.dtype:
    if name not in (None, "auto"):
        return _DTYPES[name]
    if device.type == "cpu":  # bfloat16 only where the CPU multiplies it in hardware, as vLLM's CPU build
        return torch.bfloat16 if fast_bfloat16() else torch.float32
    stored = getattr(hf, "torch_dtype", None) or getattr(hf, "dtype", None)
    stored = str(stored).replace("torch.", "") if stored is not None else "bfloat16"
    return _DTYPES.get(stored, torch.bfloat16) if stored != "float32" else torch.bfloat16
