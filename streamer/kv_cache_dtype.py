"""The KV cache's element type (`kv_cache_dtype`): the model's dtype, or fp8 e4m3 at half of
bfloat16's bytes (a quarter of float32's), so the same memory holds twice the blocks."""

from __future__ import annotations

import torch

FP8_NAMES = ("fp8", "fp8_e4m3")
# As vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT: a calibrated scale maps max|k| to 200 and max|v| to
# 100, inside e4m3's 448, so later values up to 2.2x / 4.5x the calibration's maximum still fit.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if kv_cache_dtype in FP8_NAMES else model_dtype


def calibrated_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """`(k_scale, v_scale)` from one forward's keys and values; a zero maximum keeps scale 1."""
    k_max, v_max = float(key.abs().max()), float(value.abs().max())
    return (k_max / K_SCALE_RANGE if k_max > 0 else 1.0), (v_max / V_SCALE_RANGE if v_max > 0 else 1.0)
