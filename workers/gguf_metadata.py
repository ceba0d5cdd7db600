"""What a GGUF file says beyond what transformers' GGUF reader puts into the config it builds, read
as llama.cpp reads it (llama.cpp defines what a GGUF file means), and which files the conversion
(workers/default_model.py) accepts.

transformers' reader leaves out, for Gemma, the soft-capping values the file stores and the query
scale llama.cpp derives (it keeps its config defaults, 50/30 and 256, whatever the file says) and
a Gemma 3 file without a sliding window (all layers global in llama.cpp), and, for every
architecture, the RoPE scaling the file stores: a linear one's keys, Llama 3.1's rope_freqs tensor
(YaRN's keys are not read here either). llama.cpp also ends a generation at the file's
end-of-turn tokens (Gemma 3's `<end_of_turn>`, which its files do not declare), where
transformers stops at the one eos id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.errors import UnsupportedModel

# general.architecture of the files the conversion accepts (each one tested in
# tests/system/test_gguf.py), and what users call those models.
GGUF_ARCHITECTURES = {
    "llama": "Llama (and Mistral)",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3": "Gemma 3 (text)",
}

# llama.cpp ends a generation at the file's eos, eot and eom tokens and at any token spelled as one
# of these (llama-vocab.cpp), whether the file declares it or not.
END_OF_GENERATION_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)

# llama.cpp scales Gemma's queries by 1/sqrt(head_dim), except in the 27B models, which it knows
# by their layer count, by 1/sqrt(hidden / heads) (their config's query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def read_metadata(reader: Any) -> dict[str, Any]:
    """The file's single-valued settings (numbers, strings) from a `gguf.GGUFReader`, keyed as in
    the file; arrays (the vocabulary, the merges) are left out."""
    import gguf

    values = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        part = field.parts[field.data[0]]
        string = field.types[0] == gguf.GGUFValueType.STRING
        values[key] = bytes(part).decode("utf-8") if string else part.item()
    return values


def read_tokens(reader: Any) -> list[str]:
    """The file's vocabulary (tokenizer.ggml.tokens), a token's id its position."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data] if field else []


def check_architecture(path: Path, metadata: dict[str, Any]) -> str:
    """The file's architecture, or UnsupportedModel saying which ones are converted and what to do."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        names = ", ".join(f"{name} ({key})" for key, name in GGUF_ARCHITECTURES.items())
        raise UnsupportedModel(
            f"{path}: a GGUF file of architecture {arch!r} is not supported; --model FILE.gguf takes "
            f"GGUF files of {names}. For another model pass its Hugging Face checkpoint directory "
            "(--model DIR) of a supported family (README: Supported models)")
    return str(arch)


def complete_config(config: Any, metadata: dict[str, Any]) -> None:
    """Set on `config` (built by transformers from the file) what the file says and transformers
    left out."""
    arch = metadata["general.architecture"]
    if arch in _GEMMA_27B_LAYERS:
        big = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"{arch}.{key}" in metadata:  # absent: llama.cpp's defaults, which are transformers' too
                setattr(config, key, metadata[f"{arch}.{key}"])
    if arch == "gemma3" and not metadata.get("gemma3.attention.sliding_window"):
        # llama.cpp: no window in the file, no sliding layers (transformers would slide within 4096).
        config.sliding_window = None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    if metadata.get(f"{arch}.rope.scaling.type") == "linear":
        # Gemma 3 scales the RoPE of its global layers only; other families have one set of parameters.
        rope = config.rope_parameters.get("full_attention", config.rope_parameters)
        rope.update(rope_type="linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))


def read_rope_freqs(reader: Any) -> Any:
    """The rope_freqs tensor (numpy) of a `gguf.GGUFReader`, None without one."""
    import numpy as np

    return next((np.asarray(t.data, dtype=np.float64) for t in reader.tensors if t.name == "rope_freqs.weight"), None)


def llama3_rope(path: Path, factors: Any, rope_theta: float) -> dict[str, Any]:
    """transformers' `rope_type: llama3` parameters from the rope_freqs tensor llama.cpp stores for
    them (Llama 3.1 and later): each rotary frequency's divisor, 1 above the high-frequency bound,
    `factor` below the low one, and between them 1/divisor linear in 1/wavelength, which gives the
    bounds. They are known up to a common scale of original_max_position_embeddings, low_freq_factor
    and high_freq_factor, which changes no frequency: low_freq_factor is taken as 1, Llama's."""
    import numpy as np

    dim = 2 * len(factors)
    wavelen = 2 * np.pi * rope_theta ** (np.arange(0, dim, 2) / dim)
    factor = float(factors.max())
    medium = ~np.isclose(factors, 1, rtol=1e-6) & ~np.isclose(factors, factor, rtol=1e-6)
    if medium.sum() >= 2:
        # smooth = (old / wavelen - low) / (high - low) = slope / wavelen + intercept
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        high = 1 - 1 / intercept
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                "high_freq_factor": round(float(high), 4),
                "original_max_position_embeddings": round(float(slope * (high - 1)))}
        old, low, high = rope["original_max_position_embeddings"], 1.0, rope["high_freq_factor"]
        smooth = (old / wavelen - low) / (high - low)
        again = np.where(wavelen < old / high, 1.0,
                         np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        if np.allclose(again, factors, rtol=1e-4):
            return rope
    raise UnsupportedModel(
        f"{path}: its rope_freqs tensor is not a Llama 3 RoPE scaling that can be read back (at least two "
        "frequencies between its bounds are needed); pass the model's Hugging Face checkpoint directory "
        "(--model DIR) instead")


def end_of_generation_ids(metadata: dict[str, Any], tokens: list[str]) -> list[int]:
    """The ids llama.cpp ends a generation at: the declared eos, eot and eom, then the file's tokens
    (`tokens`, read_tokens) named as end markers."""
    declared = [metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    ids = {token: i for i, token in enumerate(tokens)}
    named = [ids[name] for name in END_OF_GENERATION_NAMES if name in ids]
    return list(dict.fromkeys(int(i) for i in [*declared, *named] if i is not None))
