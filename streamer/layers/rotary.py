"""The rotary cos/sin table, computed exactly as Hugging Face does for the checkpoint's config
(default, linear, dynamic-free llama3, yarn, longrope, ... scaling all come from its rope
initialiser), and rotary applied to the first `rotary_dim` features of each head."""

from __future__ import annotations

from typing import Any

import torch

from streamer.attention.backend import AttentionBackend


def build_cos_sin_cache(hf_config: Any, max_positions: int, device: torch.device,
                        layer_type: str | None = None) -> torch.Tensor:
    """`[max_positions, rotary_dim]`: cos of the rotary_dim/2 frequencies, then their sin. With
    `layer_type` ("sliding_attention", "full_attention"), that type's own RoPE parameters (Gemma 3:
    a local base for sliding layers, a scaled global one for the others)."""
    inv_freq, scale = _rope_frequencies(hf_config, max_positions, layer_type)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float().cpu()[None, :]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(device)


def rotary_dim(hf_config: Any, head_size: int) -> int:
    """How many leading features of each head rotate (Phi-4-mini: 3/4 of them)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return int(head_size * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))


def apply_rotary(backend: AttentionBackend, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, heads * head_size]` and k by position through the backend's kernel. With
    partial rotary only each head's first `cos_sin_cache.shape[1]` features turn: they are copied
    out as heads of that size, rotated, and written back."""
    rot = cos_sin_cache.shape[1]
    if rot == head_size:
        return backend.rotary(positions, q, k, cos_sin_cache, head_size)
    qh, kh = q.reshape(q.shape[0], -1, head_size), k.reshape(k.shape[0], -1, head_size)
    # Copies, always: a view (one head per rank, one row) would be rotated in place and then
    # written back onto itself.
    q_rot = torch.empty(qh[..., :rot].shape, dtype=q.dtype, device=q.device).copy_(qh[..., :rot])
    k_rot = torch.empty(kh[..., :rot].shape, dtype=k.dtype, device=k.device).copy_(kh[..., :rot])
    q_rot, k_rot = backend.rotary(positions, q_rot.view(q.shape[0], -1), k_rot.view(k.shape[0], -1),
                                  cos_sin_cache, rot)
    qh[..., :rot] = q_rot.view(q.shape[0], -1, rot)
    kh[..., :rot] = k_rot.view(k.shape[0], -1, rot)
    return qh.view(q.shape[0], -1), kh.view(k.shape[0], -1)


def _rope_frequencies(hf_config: Any, max_positions: int, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """transformers' own frequencies and scaling for the checkpoint's RoPE type, without importing a
    modeling module (importing modeling_llama costs 3 s of every worker start).

    LongRoPE (Phi-3): transformers switches between the short and the long factors by the length
    of each forward call, so a sequence that grows past the original context holds keys rotated
    both ways. The engine picks one set for every position, by the longest context it serves (as
    vLLM does): short where `max_model_len` is within the original context, long beyond it. It
    equals transformers' for any sequence within the original context in the first case and for
    any prompt longer than it in the second."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters if layer_type is None else hf_config.rope_parameters[layer_type]
    if params["rope_type"] != "default":
        extra: dict[str, Any] = {"seq_len": max_positions} if params["rope_type"] == "longrope" else {}
        if layer_type is not None:
            extra["layer_type"] = layer_type
        with torch.device("cpu"):
            inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, **extra)
        return inv_freq, float(scale)
    # The "default" type as LlamaRotaryEmbedding.compute_default_rope_parameters has it.
    head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = rotary_dim(hf_config, head)
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
