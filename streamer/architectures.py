"""The checkpoint architectures the engine runs (config.json `architectures`), without importing torch:
the CLI checks a model directory before any worker starts. Each maps to its family, whose module in
streamer/models/ builds it (streamer/models/registry.py)."""

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

# What users call the models of each family, for error messages and docs.
FAMILY_NAMES = {
    "llama": "Llama 2/3",
    "mistral": "Mistral",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "phi3": "Phi-3/3.5/4",
    "gemma2": "Gemma 2",
    "gemma3": "Gemma 3 (text)",
    "qwen3_moe": "Qwen3-MoE",
    "mixtral": "Mixtral",
}


def unsupported_message(found: str) -> str:
    """The one line a user reads when their checkpoint's architecture is not one of ours."""
    families = ", ".join(dict.fromkeys(FAMILY_NAMES[f] for f in SUPPORTED_ARCHITECTURES.values()))
    return (f"architecture {found} is not supported; use a checkpoint of one of: {families} "
            f"(config.json architectures: {', '.join(SUPPORTED_ARCHITECTURES)}), or convert yours to one")
