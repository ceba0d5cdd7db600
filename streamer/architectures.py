"""The checkpoint architectures the engine runs (config.json `architectures`), without importing torch:
the CLI checks a model directory before any worker starts."""

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
