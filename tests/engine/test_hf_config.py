"""The resolved-config cache (streamer/hf_config.py): a warm start reads the config back as a plain
PretrainedConfig with the same attributes, and skips the second of imports transformers' config classes
cost; the engine built from it gives the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamer.hf_config import cached_config_path, load_hf_config
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_cached_config_has_every_attribute_of_the_resolved_one(tmp_path: Path, cache: Path, arch: str) -> None:
    ckpt = build_checkpoint(tmp_path / arch, TinyModelSpec(arch=arch), seed=3)
    first = load_hf_config(ckpt)
    assert type(first).__name__ != "PreTrainedConfig"  # resolved by the architecture's class
    assert cached_config_path(ckpt).is_file() and cached_config_path(ckpt).is_relative_to(cache)
    second = load_hf_config(ckpt)
    assert type(second).__name__ == "PreTrainedConfig"
    # use_cache is generate()'s switch, which the architecture class keeps out of its attributes
    # when it is the default: nothing of the engine reads it.
    resolved = {k: v for k, v in vars(first).items() if k != "use_cache"}
    assert {k: getattr(second, k, "missing") for k in resolved} == resolved


def test_an_edited_config_is_resolved_again(tmp_path: Path, cache: Path) -> None:
    ckpt = build_checkpoint(tmp_path / "m", TinyModelSpec(), seed=4)
    load_hf_config(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (ckpt / "config.json").write_text(json.dumps(config))
    assert load_hf_config(ckpt).rms_norm_eps == 1e-3


def test_a_damaged_cache_entry_is_resolved_again(tmp_path: Path, cache: Path) -> None:
    ckpt = build_checkpoint(tmp_path / "m", TinyModelSpec(), seed=5)
    load_hf_config(ckpt)
    cached_config_path(ckpt).write_text("{not json")
    assert type(load_hf_config(ckpt)).__name__ != "PreTrainedConfig"
    assert json.loads(cached_config_path(ckpt).read_text())["rms_norm_eps"] > 0  # rewritten whole


ENGINE = """
import json, sys
from streamer import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", num_kv_blocks=64))
engine.add_request("r", "hello world", SamplingParams(max_tokens=8, temperature=0.0))
tokens = []
while engine.has_unfinished_requests():
    for out in engine.step():
        tokens += out.outputs[0].token_ids
print(json.dumps({"tokens": tokens, "heavy_imports": "torch.distributed.tensor" in sys.modules,
                  "tokenizer": type(engine.tokenizer).__name__}))
"""


def test_a_warm_start_skips_the_heavy_imports_and_generates_the_same(llama_ckpt: Path, tmp_path: Path) -> None:
    env_cache = {"STREAMER_CACHE": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", ENGINE, str(llama_ckpt)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, **env_cache}, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["heavy_imports"] and not warm["heavy_imports"]
    assert len(warm["tokens"]) == 8 and warm["tokens"] == cold["tokens"]
    assert warm["tokenizer"] == cold["tokenizer"]

