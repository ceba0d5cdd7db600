"""Gemma 2 and Gemma 3 (text) over the paged KV cache.

What differs from the Llama decoder (streamer/models/llama.py, whose attention and MLP these
extend):
- layers alternate sliding-window and global attention (`layer_types`); a sliding layer attends to
  its last `sliding_window` keys, through the kernels' window (keys before it are never read);
- the attention scale is query_pre_attn_scalar^-0.5, not head_size^-0.5;
- Gemma 2 caps attention scores (attn_logit_softcapping) and the final logits
  (final_logit_softcapping) with softcap * tanh(x / softcap);
- Gemma 3 norms q and k per head before rotary, and its sliding layers rotate with their own
  (local) RoPE base;
- the MLP is GeGLU (gelu with the tanh approximation), the embeddings are scaled by sqrt(hidden),
  RMSNorm scales by (1 + w), and each sublayer's output is normed again before its residual add
  (post-attention and pre/post-feedforward norms).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.attention.backend import AttentionBackend, AttentionMetadata, Rows
from streamer.layers.attention import sliding_window
from streamer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from streamer.layers.norm import GemmaRMSNorm, norm_heads
from streamer.layers.rotary import build_cos_sin_cache
from streamer.models.checkpoint_names import HFCheckpointNames
from streamer.models.llama import LlamaAttention, LlamaMLP


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: Any, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__(cfg, backend, qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                         scale=cfg.query_pre_attn_scalar ** -0.5,
                         window=sliding_window(cfg, layer_idx),
                         softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0))
        self.qk_norms = cfg.model_type == "gemma3_text"
        if self.qk_norms:
            self.q_norm = GemmaRMSNorm(self.head_size, cfg.rms_norm_eps, backend)
            self.k_norm = GemmaRMSNorm(self.head_size, cfg.rms_norm_eps, backend)

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.qk_norms:
            return q, k
        return norm_heads(self.q_norm, q, self.head_size), norm_heads(self.k_norm, k, self.head_size)


class GemmaMLP(LlamaMLP):
    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.self_attn = GemmaAttention(cfg, backend, layer_idx)
        self.mlp = GemmaMLP(cfg, backend)
        norm = [GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[0], norm[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2], norm[3]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
                rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward. The residual add before each sublayer is fused into the
        norm that follows it (input_layernorm, pre_feedforward_layernorm)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta, cos_sin_cache, rows))
        if rows is not None:
            residual = residual[rows.index]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(HFCheckpointNames, nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.weight_shared = True
        # transformers scales the embeddings by sqrt(hidden) rounded to the model's dtype.
        self.normalizer = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.get_default_dtype()).item()
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        # Gemma 3 keeps RoPE parameters per layer type; Gemma 2 one set for all layers.
        per_type = cfg.model_type == "gemma3_text"
        self.rotary = {t: build_cos_sin_cache(cfg, max_positions, device, t if per_type else None)
                       for t in sorted(set(cfg.layer_types))}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: Rows | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward."""
        x = self.embed_tokens(input_ids) * self.normalizer
        residual = None
        *layers, last = self.layers
        for layer in layers:
            x, residual = layer(positions, x, residual, meta, self.rotary[layer.layer_type])
        x, residual = last(positions, x, residual, meta, self.rotary[last.layer_type], rows)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
