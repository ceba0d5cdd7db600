"""Mixtral: Mistral's decoder with a mixture-of-experts MLP (streamer/layers/moe.py) on every
layer; the router always renormalises its top-k weights and keeps them in float32. The
checkpoint's `block_sparse_moe` is our `mlp`."""

from __future__ import annotations

from typing import Any

from torch import nn

from streamer.attention.backend import AttentionBackend
from streamer.layers.moe import FusedMoE, expert_weight
from streamer.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg: Any, backend: AttentionBackend, layer_idx: int) -> nn.Module:
        return FusedMoE(cfg, cfg.num_local_experts, cfg.intermediate_size, renormalize=True,
                        weights_in_hidden_dtype=False, backend=backend)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

    def checkpoint_name_to_param(self, name: str) -> tuple[str, Any] | None:
        return expert_weight(name) or super().checkpoint_name_to_param(name.replace(".block_sparse_moe.", ".mlp."))
