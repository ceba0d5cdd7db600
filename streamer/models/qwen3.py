"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and of k before rotary."""

from __future__ import annotations

from typing import Any

import torch

from streamer.attention.backend import AttentionBackend
from streamer.layers.norm import RMSNorm, norm_heads
from streamer.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: Any, backend: AttentionBackend, qkv_bias: bool, **options: Any) -> None:
        super().__init__(cfg, backend, qkv_bias, **options)
        self.q_norm = RMSNorm(self.head_size, cfg.rms_norm_eps, backend)
        self.k_norm = RMSNorm(self.head_size, cfg.rms_norm_eps, backend)

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return norm_heads(self.q_norm, q, self.head_size), norm_heads(self.k_norm, k, self.head_size)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
