"""The tiny random checkpoint of each model family the parity tests hold against transformers
(beyond the Llama and Qwen2 fixtures of conftest.py): small shapes, each family's own features on."""

from __future__ import annotations

import random
from typing import Any

from streamer.random_checkpoint import TinyModelSpec


def longrope(rotary_dim: int, original_max: int, seed: int = 0) -> dict[str, Any]:
    """Phi-3's LongRoPE parameters with distinct random short and long factors per frequency."""
    rng = random.Random(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary_dim / 16,
            "original_max_position_embeddings": original_max,
            "short_factor": [round(rng.uniform(1.0, 2.0), 3) for _ in range(rotary_dim // 2)],
            "long_factor": [round(rng.uniform(2.0, 8.0), 3) for _ in range(rotary_dim // 2)]}


def phi3_spec(original_max: int) -> TinyModelSpec:
    """Phi-3 (fused qkv_proj and gate_up_proj) with LongRoPE on 12 of each head's 16 features, as
    Phi-4-mini turns 3/4 of them. Its pad id defaults past the tiny vocabulary."""
    return TinyModelSpec(arch="phi3", extra={"pad_token_id": 0, "original_max_position_embeddings": original_max,
                                             "rope_parameters": longrope(12, original_max)})


FAMILIES: dict[str, TinyModelSpec] = {
    # head_dim is Qwen3's own field (its default, 128, is not hidden / heads).
    "qwen3": TinyModelSpec(arch="qwen3", extra={"head_dim": 16}),
    # The original context is the whole context here: the short factors rotate every position (the
    # long ones are tested in test_phi3_longrope.py).
    "phi3": phi3_spec(original_max=1024),
    # A window of 24 keys, far shorter than most parity prompts; the second layer is global.
    # Small caps, so that capping changes the scores and logits of these random weights.
    "gemma2": TinyModelSpec(arch="gemma2", tie_word_embeddings=True, extra={
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 24,
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}),
    # Local RoPE base on the sliding layer, a linearly scaled global one on the other.
    "gemma3": TinyModelSpec(arch="gemma3_text", tie_word_embeddings=True, extra={
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
    # 8 experts, 2 a token; Qwen3-MoE without renormalising the top-k weights (Mixtral always does).
    "qwen3_moe": TinyModelSpec(arch="qwen3_moe", extra={
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": False}),
    "mixtral": TinyModelSpec(arch="mixtral", extra={"num_local_experts": 8, "num_experts_per_tok": 2}),
}
