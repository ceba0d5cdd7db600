"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Phi-3) over the paged KV cache.

One implementation serves all four: Qwen2 differs only by biases on the QKV projection and
(often) tied embeddings, Mistral by its sliding window (the attention's `window`, as Qwen2's
sliding layers with use_sliding_window), Phi-3 by its
checkpoint's fused qkv_proj and gate_up_proj tensors (the layers' loaders split them), LongRoPE
and partial rotary (streamer/layers/rotary.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.attention.backend import AttentionBackend, AttentionMetadata, Rows
from streamer.layers.attention import PagedAttention, sliding_window
from streamer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from streamer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from streamer.layers.norm import RMSNorm
from streamer.layers.rotary import apply_rotary, build_cos_sin_cache
from streamer.models.checkpoint_names import HFCheckpointNames
from streamer.parallel_state import get_tp_size


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend, qkv_bias: bool, scale: float | None = None,
                 window: int = 0, softcap: float = 0.0) -> None:
        """`scale` (default head_size^-0.5), `window` and `softcap`: the attention's options
        (streamer/layers/attention.py), for families that set them."""
        super().__init__()
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_size, cfg.num_attention_heads,
                                          num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_size, cfg.hidden_size,
                                        bias=cfg.model_type != "qwen2" and getattr(cfg, "attention_bias", False))
        self.q_size = self.qkv_proj.num_heads * self.head_size
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_size
        self.backend = backend
        self.attn = PagedAttention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_size,
                                   self.head_size ** -0.5 if scale is None else scale, backend, window, softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.before_rotary(q, k)
        q, k = apply_rotary(self.backend, positions, q, k, cos_sin_cache, self.head_size)
        return self.o_proj(self.attn(q, k, v, meta, rows))

    def before_rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a family does to q and k between the projection and rotary (Llama: nothing)."""
        return q, k


# A long float32 prefill step's MLP runs on the CPU in slices of this many rows: at 2,048 rows
# the gate/up output (2,048 x 2 x the intermediate size) outgrows the caches between its GEMM and
# SiLU-and-mul, and the MLP measured 7-17% slower than in two slices. bfloat16 runs whole: its
# intermediate is half the bytes, and oneDNN's AMX kernels slow down at 512-1,024 rows (the down
# projection at 1.3-1.4 TFLOP/s against 2.6 at 2,048), so a 2,048-row MLP took 8.1-8.6 ms whole
# against 10.8-11.0 in two slices (bench/README.md).
CPU_MLP_ROWS = {torch.float32: 1024}


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = CPU_MLP_ROWS.get(x.dtype)
        # LoRA hooks (streamer/lora) know the step's rows, not a slice of them: once this model
        # serves adapters, its MLP runs whole.
        lora = getattr(self.gate_up_proj, "_forward_hooks", None)
        if x.device.type != "cpu" or rows is None or len(x) <= rows or lora:
            return self._mlp(x)
        out = torch.empty_like(x)
        for start in range(0, len(x), rows):
            out[start:start + rows] = self._mlp(x[start:start + rows])
        return out

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: Any, backend: AttentionBackend, qkv_bias: bool, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, backend, qkv_bias, window=sliding_window(cfg, layer_idx))
        self.mlp = self.build_mlp(cfg, backend, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def build_mlp(self, cfg: Any, backend: AttentionBackend, layer_idx: int) -> nn.Module:
        """This layer's MLP (a mixture-of-experts family picks per layer)."""
        return LlamaMLP(cfg, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, cos_sin_cache: torch.Tensor,
                rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V; the output of every row, or of `rows` only (in their order)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, cos_sin_cache, rows)
        if rows is not None:
            residual = residual[rows.index]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(HFCheckpointNames, nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: Any, backend: AttentionBackend, max_positions: int, device: torch.device) -> None:
        super().__init__()
        qkv_bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, backend, qkv_bias, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.weight_shared = True
        self.tied = bool(cfg.tie_word_embeddings)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(cfg, max_positions, device), persistent=False)
        self.tp_size = get_tp_size()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: Rows | None = None) -> torch.Tensor:
        """Final hidden states of every row, or of `rows` only: past the last layer only the sampled
        rows are read, so that layer computes the rest (its queries, attention output, MLP) for
        them alone, and only K/V for the others (a long prompt's step: 1/L of the work less)."""
        x = self.embed_tokens(input_ids)
        residual = None
        *layers, last = self.layers
        for layer in layers:
            x, residual = layer(positions, x, residual, meta, self.cos_sin_cache)
        x, residual = last(positions, x, residual, meta, self.cos_sin_cache, rows)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
