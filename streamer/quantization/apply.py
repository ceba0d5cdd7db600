"""Quantizing a loaded model's linear layers in place (`--quantization`)."""

from __future__ import annotations

import torch
from torch import nn

from streamer.quantization.fp8 import Fp8Weight
from streamer.quantization.int8 import Int8Weight

_METHODS = {"int8": Int8Weight, "fp8": Fp8Weight}
QUANTIZATION_METHODS = tuple(_METHODS)


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the weight of every layer with a `packed` slot (the attention and MLP projections and
    the LM head; streamer/layers/linear.py, embedding.py) by its quantized form. A tied LM head keeps
    the embedding's dense weight, which the lookup needs, and gets a quantized copy. Returns how many
    layers were quantized. Mixture-of-experts expert weights are not slots and stay dense."""
    cls = _METHODS[method]
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed") or module.packed is not None:
            continue
        module.packed = cls.from_dense(module.weight.detach())
        count += 1
        if not getattr(module, "weight_shared", False):
            module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
    return count
