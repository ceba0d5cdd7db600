"""The model class for a checkpoint's config: its first supported `architectures` entry."""

from __future__ import annotations

from typing import Any

from torch import nn

from streamer.architectures import SUPPORTED_ARCHITECTURES


def model_class(hf_config: Any) -> type[nn.Module]:
    archs = [a for a in getattr(hf_config, "architectures", None) or [] if a in SUPPORTED_ARCHITECTURES]
    if not archs:  # ModelConfig.load refuses such a checkpoint before a model is built
        raise ValueError(f"no supported architecture in {hf_config.architectures!r}")
    family = SUPPORTED_ARCHITECTURES[archs[0]]
    # Imported on demand: a worker pays only for its own family's module.
    if family in ("gemma2", "gemma3"):
        from streamer.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM
    if family == "qwen3_moe":
        from streamer.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    if family == "mixtral":
        from streamer.models.mixtral import MixtralForCausalLM

        return MixtralForCausalLM
    if family == "qwen3":
        from streamer.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    from streamer.models.llama import LlamaForCausalLM  # llama, mistral, qwen2, phi3

    return LlamaForCausalLM
