"""Qwen3-MoE: Qwen3's attention (q/k norms) and a mixture-of-experts MLP (streamer/layers/moe.py)
on every `decoder_sparse_step`-th layer not in `mlp_only_layers` (the others keep a dense MLP).
The router's top-k weights are renormalised only with `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

from torch import nn

from streamer.attention.backend import AttentionBackend
from streamer.layers.moe import FusedMoE, expert_weight
from streamer.models.llama import LlamaMLP
from streamer.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, cfg: Any, backend: AttentionBackend, layer_idx: int) -> nn.Module:
        sparse = (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
                  and (layer_idx + 1) % cfg.decoder_sparse_step == 0)
        if not sparse:
            return LlamaMLP(cfg, backend)
        return FusedMoE(cfg, cfg.num_experts, cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob),
                        weights_in_hidden_dtype=True, backend=backend)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def checkpoint_name_to_param(self, name: str) -> tuple[str, Any] | None:
        return expert_weight(name) or super().checkpoint_name_to_param(name)
