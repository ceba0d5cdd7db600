"""Build small Hugging Face checkpoints with random weights, for tests and benchmarks.

No model hub is needed: the tokenizer is a byte-level BPE trained on a built-in text with the
`tokenizers` library, and the model is created by transformers and saved with `save_pretrained`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in
fixed-size blocks. Continuous batching admits new requests at every step. Redis streams carry jobs
from clients in any language to workers. Tokens flow back over pub/sub to browsers. Héllo wörld,
naïve café, 日本語のテキスト, emoji 🙂🚀 and numbers 0123456789 test multi-byte boundaries.
def main():\n    return [x * 2 for x in range(10)]\n"""


@dataclass
class TinyModelSpec:
    """Shape of a random checkpoint. `arch` is a transformers model_type ("llama", "qwen2", "mistral",
    "qwen3", ...); `extra` holds that family's own config fields."""

    arch: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    extra: dict[str, Any] = field(default_factory=dict)


def build_tokenizer(vocab_size: int, path: Path) -> Any:
    """Train a byte-level BPE with exactly `vocab_size` entries and save it as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # Pad the vocabulary with unused tokens so the model's vocab size is exact.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_checkpoint(path: str | Path, spec: TinyModelSpec | None = None, seed: int = 0,
                     dtype: str = "float32", max_shard_size: str | None = None) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random model into `path`."""
    import torch
    import transformers

    spec = spec or TinyModelSpec()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, path)
    common = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **spec.extra,
    )
    # Any family transformers knows, by its model_type ("llama", "qwen3", "gemma2", ...): its own
    # config class fills the family's defaults, and its own model class writes the weights.
    config = transformers.AutoConfig.for_model(spec.arch, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Larger-than-default init spreads the logits, so greedy argmax ties are vanishingly rare
    # and parity with transformers is a meaningful test rather than a coin toss on ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(getattr(torch, dtype)).save_pretrained(str(path), **extra)
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        cfg = json.loads(generation_config.read_text())
        cfg.pop("max_length", None)
        generation_config.write_text(json.dumps(cfg, indent=2))
    return path


def moe_bench_spec() -> TinyModelSpec:
    """A Qwen3-MoE shaped for 2 CPU cores (bench/README.md's MoE row): 8 experts, 2 a token, 8
    layers of hidden 512, 32k vocabulary (tied): ~73M parameters, ~35M of them active a token."""
    return TinyModelSpec(
        arch="qwen3_moe",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        extra={"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
               "norm_topk_prob": True},
    )


def bench_spec() -> TinyModelSpec:
    """The ~110M-parameter Llama (32k vocab) used by the throughput benchmark."""
    return TinyModelSpec(
        arch="llama",
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
