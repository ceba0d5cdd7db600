"""The rotary cos/sin table, computed exactly as Hugging Face does for the checkpoint's config
(default, linear, dynamic-free llama3, yarn, ... scaling all come from its rope initialiser)."""

from __future__ import annotations

from typing import Any

import torch


def build_cos_sin_cache(hf_config: Any, max_positions: int, device: torch.device) -> torch.Tensor:
    """`[max_positions, head_size]`: cos of the head_size/2 frequencies, then their sin."""
    inv_freq, scale = _rope_frequencies(hf_config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(device)


def _rope_frequencies(hf_config: Any) -> tuple[torch.Tensor, float]:
    """transformers' own frequencies and scaling for the checkpoint's RoPE type, without importing a
    modeling module (importing modeling_llama costs 3 s of every worker start)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters
    if params["rope_type"] != "default":
        with torch.device("cpu"):
            inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config)
        return inv_freq, float(scale)
    # The "default" type as LlamaRotaryEmbedding.compute_default_rope_parameters has it.
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
