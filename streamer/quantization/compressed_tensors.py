"""Reading int8 checkpoints in compressed-tensors' `int-quantized` format (what llm-compressor
writes for W8A16 and what transformers' compressed-tensors integration reads): per linear layer
`weight` int8 `[out, in]`, `weight_scale` `[out, 1]` (per channel) and `weight_zero_point` (zeros:
symmetric), with `quantization_config.quant_method == "compressed-tensors"` in config.json.

The checkpoint's own int8 values and scales are kept as they are (no requantization): the weight
parameter receives the int8 values (exact in any float dtype), a `weight_scale` parameter added to
the layer receives the scales, and `load_prequantized` turns each such layer into an `Int8Weight`.
Layers the checkpoint keeps dense (its `ignore` list, typically the LM head) stay dense, unless
`--quantization int8` quantizes them too. Other schemes (`pack-quantized`, int4, activations
quantized: W8A8, fp8 `float-quantized`) are refused with a message saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from streamer.errors import ConfigError
from streamer.model_loader import checkpoint_files
from streamer.quantization.int8 import Int8Weight

SKIPPED_SUFFIXES = (".weight_zero_point", ".weight_g_idx")  # zeros for symmetric int8; no act-order


def _config(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def is_compressed_int8(hf_config: Any) -> bool:
    """Whether the checkpoint is compressed-tensors weight-only int8 per channel; raises for another
    compressed-tensors scheme (its tensors would not load as dense ones)."""
    qc = _config(hf_config)
    if qc is None or qc.get("quant_method") != "compressed-tensors":
        return False
    groups = list(qc.get("config_groups", {}).values())
    weights = [g.get("weights") or {} for g in groups]
    ok = (qc.get("format") == "int-quantized" and groups
          and all(w.get("num_bits") == 8 and w.get("type") == "int" and w.get("symmetric", True)
                  and w.get("strategy") == "channel" for w in weights)
          and not any(g.get("input_activations") for g in groups))
    if not ok:
        raise ConfigError(f"compressed-tensors checkpoint in format {qc.get('format')!r} with weights {weights} is "
                          "not supported: streamer reads int-quantized, 8-bit symmetric per-channel weight-only "
                          "(W8A16) checkpoints; use the dense checkpoint with --quantization int8")
    return True


def _flat_loader(module: nn.Module) -> Any:
    """The layer's own loader (tensor-parallel shards, fused q/k/v and gate/up parts) applied to the
    `[out, 1]` scales as a vector; row-parallel layers split inputs, so every rank takes all scales."""
    if hasattr(module, "input_size_per_rank"):
        return lambda param, loaded, shard_id=None: param.data.copy_(loaded[:].reshape(-1))
    return lambda param, loaded, shard_id=None: module.weight_loader(param, loaded[:].reshape(-1), shard_id)


def add_scale_slots(model: nn.Module, root: Path) -> None:
    """A float32 `weight_scale` parameter on every layer whose checkpoint tensors carry scales."""
    modules = dict(model.named_modules())
    for file in checkpoint_files(root):
        with safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if n.endswith(".weight_scale")]  # noqa: SIM118 - not a dict
        for name in names:
            target = model.checkpoint_name_to_param(name)
            if target is None:
                continue
            module = modules[target[0].rsplit(".", 1)[0]]
            if not hasattr(module, "weight_scale"):
                scale = nn.Parameter(torch.ones(module.weight.shape[0], dtype=torch.float32,
                                                device=module.weight.device), requires_grad=False)
                scale.weight_loader = _flat_loader(module)
                module.weight_scale = scale


def load_prequantized(model: nn.Module) -> int:
    """Each layer loaded with int8 values and scales becomes an `Int8Weight` of exactly those."""
    count = 0
    for module in model.modules():
        scale = getattr(module, "weight_scale", None)
        if scale is None or module.packed is not None:
            continue
        module.packed = Int8Weight(module.weight.data.round().to(torch.int8), scale.data)
        module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
        del module.weight_scale
        count += 1
    return count
