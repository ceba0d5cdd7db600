"""GGUF files written from the tiny random checkpoints, as llama.cpp's converter lays them out
(tensor names, Llama's q/k row order for its interleaved rotary, a byte-level BPE tokenizer with
its merges and chat template), with F32, F16, Q8_0 or K-quant (Q4_K, Q6_K, and the Q4_K_M mix) weights,
for the GGUF loading tests. gguf-py de-quantizes K-quants but cannot write them: `quantize_q4_k` and
`quantize_q6_k` are plain encoders of their block layouts (not llama.cpp's error-minimising search),
checked against gguf-py's de-quantizer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
TYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_K": gguf.GGMLQuantizationType.Q4_K,
         "Q6_K": gguf.GGMLQuantizationType.Q6_K}


QK_K = 256  # values per K-quant super-block


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows of a multiple of 256 values -> Q4_K blocks (144 bytes each): 8 sub-blocks of 32 values
    `d * sc * q - dmin * m`, q in 0..15, sc and m 6-bit, packed as gguf-py's get_scale_min reads them."""
    v = x.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(v.min(-1), 0), np.maximum(v.max(-1), 0)
    scale, mn = (hi - lo) / 15, -lo
    d = _f16(scale.max(-1) / 63).astype(np.float32)
    dmin = _f16(mn.max(-1) / 63).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 63)
    m = np.clip(np.round(np.divide(mn, dmin[:, None], out=np.zeros_like(mn), where=dmin[:, None] > 0)), 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(np.divide(v + (dmin[:, None] * m)[..., None], step, out=np.zeros_like(v),
                                   where=step > 0)), 0, 15).astype(np.uint8)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=-1)
    q = q.reshape(-1, 4, 2, 32)  # sub-blocks 2g and 2g+1 share the bytes of group g: low, high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16(d).view(np.uint8).reshape(-1, 2), _f16(dmin).view(np.uint8).reshape(-1, 2),
                             scales, qs], axis=-1)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of a multiple of 256 values -> Q6_K blocks (210 bytes each): 16 sub-blocks of 16 values
    `d * scale * (q - 32)`, q 6-bit (4 low bits in ql, 2 high in qh), scale int8."""
    v = x.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(v).max(-1) / 31
    d = _f16(scale.max(-1) / 127).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(np.divide(v, step, out=np.zeros_like(v), where=step > 0)), -32, 31) + 32
    u = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values, each laid out alike
    low, high = u & 0x0F, u >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    h = high.reshape(-1, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d).view(np.uint8).reshape(-1, 2)],
                            axis=-1)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 210)


def _q4_k_m(target: str) -> gguf.GGMLQuantizationType:
    """llama.cpp's Q4_K_M mix, simplified: Q6_K for the output and the attention values and FFN down
    projections, Q4_K for the rest."""
    if target == "output.weight" or ".attn_v." in target or ".ffn_down." in target:
        return gguf.GGMLQuantizationType.Q6_K
    return gguf.GGMLQuantizationType.Q4_K


_ENCODERS = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q6_K: quantize_q6_k,
             gguf.GGMLQuantizationType.Q8_0: lambda x: gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)}


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
        if w.ndim != 2:
            qtype = gguf.GGMLQuantizationType.F32
        else:
            qtype = _q4_k_m(target) if weight_type == "Q4_K_M" else TYPES[weight_type]
        data = w.astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F16:
            data = data.astype(np.float16)
        elif qtype in _ENCODERS:
            data = _ENCODERS[qtype](data)
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
