"""Checkpoints as people have them on disk: weights stored in bfloat16 or float16, sharded
safetensors with an index file (a mixture-of-experts model's experts spread over the shards),
and the error for an architecture the engine does not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import FAMILIES
from parity import hf_greedy, parity_prompts
from safetensors import safe_open

from streamer import LLM, SamplingParams
from streamer.architectures import SUPPORTED_ARCHITECTURES
from streamer.model_config import ModelConfig, UnsupportedModelError
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

BUDGETS = (12, 6, 9)


def _greedy(ckpt: Path, dtype: str) -> list[list[int]]:
    prompts = parity_prompts(512, seed=4)[2:5]
    llm = LLM(str(ckpt), dtype=dtype, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n) for n in BUDGETS])
    return [o.outputs[0].token_ids for o in outs]


def _reference(ckpt: Path) -> list[list[int]]:
    """transformers on the same stored weights, computing in float32."""
    return hf_greedy(ckpt, tuple(map(tuple, parity_prompts(512, seed=4)[2:5])), BUDGETS)


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_half_precision_checkpoint_runs_in_float32_as_transformers(stored: str, tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path / stored, FAMILIES["qwen3"], seed=2, dtype=stored)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, stored)}  # noqa: SIM118
    assert _greedy(ckpt, "float32") == _reference(ckpt)


def test_bfloat16_checkpoint_runs_in_bfloat16(tmp_path: Path) -> None:
    """Its own dtype: the first greedy tokens mostly agree with float32 (drift as test_engine_parity
    reports it; token-exact equality is not expected of bfloat16)."""
    ckpt = build_checkpoint(tmp_path / "bf16", FAMILIES["qwen3"], seed=2, dtype="bfloat16")
    got = _greedy(ckpt, "bfloat16")
    assert sum(g[0] == r[0] for g, r in zip(got, _reference(ckpt))) >= 2


def test_sharded_mixture_of_experts_checkpoint(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path / "moe", FAMILIES["qwen3_moe"], seed=2, max_shard_size="100KB")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert _greedy(ckpt, "float32") == _reference(ckpt)


def test_unsupported_architecture_names_the_supported_ones_and_what_to_do(tmp_path: Path) -> None:
    build_checkpoint(tmp_path, TinyModelSpec(arch="llama"), seed=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.load(str(tmp_path), "float32", torch.device("cpu"), None)
    message = str(err.value)
    assert "GPT2LMHeadModel is not supported" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    assert "Qwen3-MoE" in message and "convert yours" in message
