"""The attention layer: writes this step's K/V into its cache and attends through the backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.attention.backend import AttentionBackend, AttentionMetadata, Rows
from streamer.kv_cache_dtype import calibrated_scales


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 backend: AttentionBackend, window: int = 0, softcap: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.window = window  # > 0: this layer attends to its last `window` keys (sliding window)
        self.softcap = softcap  # > 0: scores capped by softcap * tanh(score / softcap)
        self.backend = backend
        # Bound by the model runner once the cache is allocated.
        self.key_cache = torch.empty(0)
        self.value_cache = torch.empty(0)
        # An fp8 cache stores k / k_scale and v / v_scale (kernels/fp8.py); other caches ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calibrate_kv_scales = False  # set by the model runner: the next forward computes the scales

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                rows: Rows | None = None) -> torch.Tensor:
        """Writes every row's K/V; attends for every row, or for `rows` only."""
        t = k.shape[0]
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        if self.calibrate_kv_scales:  # once, before anything is written with the default scales
            self.k_scale, self.v_scale = calibrated_scales(k, v)
            self.calibrate_kv_scales = False
        self.backend.write_kv(k, v, self.key_cache, self.value_cache, meta, self.k_scale, self.v_scale)
        if rows is not None:
            q, meta = q[rows.index], rows.meta
        n = q.shape[0]
        out = self.backend.forward(q.view(n, self.num_heads, self.head_size), self.key_cache,
                                   self.value_cache, meta, self.scale, window=self.window, softcap=self.softcap,
                                   k_scale=self.k_scale, v_scale=self.v_scale)
        return out.reshape(n, self.num_heads * self.head_size)


def sliding_window(cfg: Any, layer_idx: int) -> int:
    """The keys layer `layer_idx` attends to, as transformers decides it (0: all of them). With
    `layer_types` (Qwen2, Qwen3, Gemma: sliding layers chosen per layer; Qwen2/3 set sliding_window
    to None unless use_sliding_window) the sliding layers' window; without it (Mistral, Mixtral,
    Phi-3) `sliding_window` applies to every layer."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return 0
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return 0
    return int(window)
