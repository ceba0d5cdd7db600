"""Linear layers on the CPU through oneDNN with pre-packed weights.

PyTorch's CPU `F.linear` goes to MKL's sgemm, which on some x86 CPUs (AMD's in particular) takes a
generic code path; oneDNN with weights reordered once into its blocked layout measured 1.5x
faster in float32 and 1.1x in bfloat16 for the batch sizes of decoding (bench/README.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from streamer.quantization.weights import QuantizedWeight

log = logging.getLogger("streamer.layers")


def _available(dtype: torch.dtype) -> bool:
    return (torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """oneDNN's blocked copy of `weight` `[out, in]`, or None where that path is unavailable."""
    if weight.device.type != "cpu" or not _available(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError) as exc:  # an older or differently built torch
        log.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | QuantizedWeight | None) -> torch.Tensor:
    """`packed`: oneDNN's copy of `weight`, or a quantized weight (streamer/quantization) that
    replaces it, or None (the dense weight)."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):
        return packed.apply(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_model(model: nn.Module, batch_hint: int) -> int:
    """Pack every layer that has a `packed` slot, and those that pack themselves
    (`pack_for_cpu`); frees the dense copy unless it is shared (tied embeddings). Returns how
    many layers were packed."""
    count = 0
    for module in model.modules():
        if hasattr(module, "pack_for_cpu"):  # a layer with its own packed layout (layers/moe.py's experts)
            count += module.pack_for_cpu()
            continue
        if not hasattr(module, "packed") or module.packed is not None:
            continue
        module.packed = pack(module.weight, batch_hint)
        if module.packed is None:
            continue
        count += 1
        if not getattr(module, "weight_shared", False):
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)  # the packed copy replaces it
    return count
