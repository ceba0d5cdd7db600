"""Quantized weights (docs/quantization.md): `--quantization int8` (weight-only, per-channel) and
`fp8` (e4m3, per-channel), applied to every linear layer after the checkpoint is loaded."""

from streamer.quantization.apply import QUANTIZATION_METHODS, quantize_model
from streamer.quantization.weights import QuantizedWeight

__all__ = ["QUANTIZATION_METHODS", "QuantizedWeight", "quantize_model"]
