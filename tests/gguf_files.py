"""GGUF files written from the tiny random checkpoints, as llama.cpp's converter lays them out
(tensor names, Llama's q/k row order for its interleaved rotary, Gemma's norms stored as 1 + w, the
settings it writes for each family, a byte-level BPE tokenizer with its merges or a sentencepiece
one with scores and token types, the chat template), with F32, F16, Q8_0 or K-quant (Q4_K, Q6_K,
and the Q4_K_M mix) weights, for the GGUF loading tests. `use_gemma_tokenizer` gives a checkpoint
a Gemma-style sentencepiece tokenizer (byte fallback, no merges in the file) first. gguf-py
de-quantizes K-quants but cannot write them: `quantize_q4_k` and `quantize_q6_k` are plain encoders
of their block layouts (not llama.cpp's error-minimising search), checked against gguf-py's
de-quantizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
          "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
GEMMAS = (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
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


def _rope(config: dict) -> dict:
    """The RoPE parameters of the (global) attention layers."""
    rope = config.get("rope_parameters") or {}
    return {"rope_theta": config.get("rope_theta"), **rope.get("full_attention", rope)}


def _add_hyperparameters(writer: gguf.GGUFWriter, config: dict, arch: gguf.MODEL_ARCH) -> None:
    """What llama.cpp's converter writes for each family (Gemma 2: no RoPE base, its soft-caps;
    Gemma 3: the global layers' RoPE base and scaling)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = _rope(config)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    else:
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch in GEMMAS:
        writer.add_sliding_window(config["sliding_window"])


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3.1's `rope_type: llama3` (no metadata key): the
    factor dividing each rotary frequency, as the rope_freqs tensor."""
    rope = _rope(config)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    wavelen = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (old / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / rope["factor"] + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, rope["factor"], medium)).astype(np.float32)


def _as_llama_cpp_stores(w: np.ndarray, name: str, arch: gguf.MODEL_ARCH, config: dict) -> np.ndarray:
    """Llama's q and k rows interleaved per head; Gemma's norms, which scale by 1 + w, stored as 1 + w."""
    if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in name:
        return _interleave_rotary(w, config["num_attention_heads"])
    if arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in name:
        return _interleave_rotary(w, config["num_key_value_heads"])
    if arch in GEMMAS and name.endswith("norm.weight"):
        return w + 1
    return w


def write_gguf(ckpt: Path, out: Path, weight_type: str = "F32") -> Path:
    """`ckpt` (a random checkpoint of `ARCHES`' families) as one GGUF file at `out`; 2-D weights in
    `weight_type`, norms in F32 (as llama.cpp keeps them)."""
    config = json.loads((ckpt / "config.json").read_text())
    arch = ARCHES[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _add_hyperparameters(writer, config, arch)
    _add_tokenizer(writer, ckpt)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, w in load_file(str(ckpt / "model.safetensors")).items():
        base = name.removesuffix(".weight").removesuffix(".bias")
        target = names.get_name(base) + name[len(base):]
        w = _as_llama_cpp_stores(w, name, arch, config)
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
    if _rope(config).get("rope_type") == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_freqs(config))
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
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    if spec["model"].get("byte_fallback"):
        _add_sentencepiece_vocab(writer, tokens, special, vocab[tok_config["unk_token"]])
        writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_chat_template((ckpt / "chat_template.jinja").read_text())


def _add_sentencepiece_vocab(writer: gguf.GGUFWriter, tokens: list[str], special: set[str], unk: int) -> None:
    """As llama.cpp writes a sentencepiece vocabulary (Gemma's): pieces, scores (higher merges
    first), token types, no merges; BOS added to each text, no space prefix."""
    def kind(i: int, t: str) -> gguf.TokenType:
        if i == unk:
            return gguf.TokenType.UNKNOWN
        if t in special:
            return gguf.TokenType.CONTROL
        return gguf.TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else gguf.TokenType.NORMAL

    types = [kind(i, t) for i, t in enumerate(tokens)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) if k == gguf.TokenType.NORMAL else 0.0 for i, k in enumerate(types)])
    writer.add_token_types(types)
    writer.add_unk_token_id(unk)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_GEMMA_CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in
fixed-size blocks. Continuous batching admits new requests at every step. def main(): return [x * 2 for x
in range(10)] Sliding windows, soft caps and norms of one plus w."""


def use_gemma_tokenizer(ckpt: Path) -> None:
    """Replace the checkpoint's tokenizer with a Gemma-style one of the same size: sentencepiece BPE
    (spaces as "▁", bytes outside the vocabulary as <0xNN> tokens), Gemma's special tokens at
    its ids (<pad> 0, <eos> 1, <bos> 2, ...), BOS added to each text, Gemma's chat template. The
    merges are rebuilt from the vocabulary order, as sentencepiece ranks them (what transformers
    does with a GGUF file, which stores none)."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    fixed = GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    bpe.train_from_iterator([_GEMMA_CORPUS.replace("\n", " ")] * 4,
                            trainers.BpeTrainer(vocab_size=size, special_tokens=fixed, show_progress=False))
    vocab = bpe.get_vocab()
    vocab |= {f"<unused{i}>": len(vocab) + i for i in range(size - len(vocab))}
    merges = generate_merges(vocab, {t: -i for t, i in vocab.items()})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (ckpt / f).unlink(missing_ok=True)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_SPECIALS[5:]}, replace_extra_special_tokens=False)
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(ckpt))
