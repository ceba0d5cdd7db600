"""The rotary cos/sin table, computed exactly as Hugging Face does for the checkpoint's config
(default, linear, dynamic-free llama3, yarn, ... scaling all come from its rope initialiser)."""

from __future__ import annotations

from typing import Any

import torch


def build_cos_sin_cache(hf_config: Any, max_positions: int, device: torch.device) -> torch.Tensor:
    """`[max_positions, head_size]`: cos of the head_size/2 frequencies, then their sin."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rope = LlamaRotaryEmbedding(config=hf_config)
    inv_freq = rope.inv_freq.float().cpu()
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    scale = float(rope.attention_scaling)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(device)
