"""GGUF files written from the tiny random checkpoints, as llama.cpp's converter lays them out
(tensor names, Llama's q/k row order for its interleaved rotary, a byte-level BPE tokenizer with
its merges and chat template), with F32, F16 or Q8_0 weights, for the GGUF loading tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
TYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def _interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q and k rows with each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: Path, out: Path, weight_type: str = "F32") -> Path:
    """`ckpt` (a random checkpoint of `ARCHES`' families) as one GGUF file at `out`; 2-D weights in
    `weight_type`, norms in F32 (as llama.cpp keeps them)."""
    config = json.loads((ckpt / "config.json").read_text())
    arch = ARCHES[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_tokenizer(writer, ckpt)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, w in load_file(str(ckpt / "model.safetensors")).items():
        base = name.removesuffix(".weight").removesuffix(".bias")
        target = names.get_name(base) + name[len(base):]
        if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in name:
            w = _interleave_rotary(w, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in name:
            w = _interleave_rotary(w, kv_heads)
        qtype = TYPES[weight_type] if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = w.astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F16:
            data = data.astype(np.float16)
        elif qtype == gguf.GGMLQuantizationType.Q8_0:
            data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(target, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, ckpt: Path) -> None:
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_chat_template((ckpt / "chat_template.jinja").read_text())
