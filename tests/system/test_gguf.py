"""`--model path/to/model.gguf`: llama.cpp files of Llama, Qwen2 and Qwen3 (written by the tests
from random checkpoints, tests/gguf_files.py) converted once into a checkpoint directory, whose
greedy tokens equal transformers' on the original weights (F32), or on the file's own weights
(F16 stored as float16, Q8_0 de-quantized), with the file's tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_files import quantize_q4_k, quantize_q6_k, write_gguf
from kernel_testing import rel_err
from parity import hf_greedy, parity_prompts
from safetensors.torch import load_file
from transformers import AutoTokenizer

from streamer import LLM, SamplingParams
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint
from workers.default_model import gguf_model_dir, resolve_model
from workers.errors import ModelNotFound

SPECS = {
    "llama": TinyModelSpec(arch="llama"),
    "qwen2": TinyModelSpec(arch="qwen2", tie_word_embeddings=True),
    # transformers reads no head size from a Qwen3 GGUF (it takes Qwen3's 128): so is this one's.
    "qwen3": TinyModelSpec(arch="qwen3", extra={"head_dim": 128}),
    # K-quants pack 256 values a block: every weight row a multiple of that.
    "llama256": TinyModelSpec(arch="llama", hidden_size=256, intermediate_size=512),
}
BUDGETS = (10, 6, 8)


def _prompts() -> list[list[int]]:
    return parity_prompts(512, seed=12)[2:5]


def _greedy(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        [SamplingParams(temperature=0, max_tokens=n) for n in BUDGETS])
    return [o.outputs[0].token_ids for o in outs]


def _convert(tmp_path: Path, arch: str, weight_type: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "cache"))
    ckpt = build_checkpoint(tmp_path / arch, SPECS[arch], seed=4)
    gguf = write_gguf(ckpt, tmp_path / f"{arch}.{weight_type}.gguf", weight_type)
    return ckpt, resolve_model(str(gguf), progress=lambda _msg: None)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_equals_transformers_on_the_original(arch: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, model_dir = _convert(tmp_path, arch, "F32", monkeypatch)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == \
        json.loads((ckpt / "config.json").read_text())["architectures"]
    original, converted = load_file(str(ckpt / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert all(torch.equal(original[k], converted[k]) for k in converted)  # Llama's q/k rows put back
    assert _greedy(model_dir) == hf_greedy(ckpt, tuple(map(tuple, _prompts())), BUDGETS)
    text = "Héllo wörld: def main(): return [x * 2 for x in range(10)]"
    ours, theirs = AutoTokenizer.from_pretrained(str(model_dir)), AutoTokenizer.from_pretrained(str(ckpt))
    assert theirs.get_vocab().items() <= ours.get_vocab().items()  # transformers' reader may add <|endoftext|>
    assert ours.decode(ours(text).input_ids) == text
    if arch != "qwen3":
        # transformers splits a Qwen3 file's text with Qwen's own pattern whatever the file says; the
        # test tokenizer was trained on GPT-2's, so only its vocabulary and round trip are the same.
        assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert resolve_model(str(tmp_path / f"{arch}.F32.gguf")) == model_dir  # converted once, then reused


@pytest.mark.parametrize("arch, weight_type, dtype, tolerance", [
    ("qwen2", "F16", torch.float16, 1e-3),  # half precision, stored as it is
    ("llama", "Q8_0", torch.bfloat16, 1e-2),  # 8-bit blocks de-quantized
    # The Q4_K_M mix (Q4_K, Q6_K for output, attn_v, ffn_down): 4-bit blocks are ~8% off the original
    ("llama256", "Q4_K_M", torch.bfloat16, 0.1),
])
def test_quantized_gguf_runs_its_own_weights(arch: str, weight_type: str, dtype: torch.dtype, tolerance: float,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, model_dir = _convert(tmp_path, arch, weight_type, monkeypatch)
    original, converted = load_file(str(ckpt / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert {t.dtype for t in converted.values()} == {dtype}
    assert all(rel_err(converted[k], original[k]) < tolerance for k in converted)
    assert _greedy(model_dir) == hf_greedy(model_dir, tuple(map(tuple, _prompts())), BUDGETS)


def test_missing_gguf_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist: pass --model path/to/model.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"))
    assert gguf_model_dir(write_gguf(build_checkpoint(tmp_path / "l", SPECS["llama"]), tmp_path / "a.gguf"),
                          tmp_path).parent == tmp_path / "models"


@pytest.mark.parametrize("rows, cols", [(1, 256), (8, 512), (3, 1024)])
def test_k_quant_encoders_write_what_gguf_reads(rows: int, cols: int) -> None:
    """The tests' Q4_K and Q6_K encoders against gguf-py's de-quantizer (the layout transformers reads):
    within the error of 4-bit (15 steps per sub-block) and 6-bit (63 steps) codes of random rows."""
    import gguf
    import numpy as np

    x = (np.random.default_rng(rows * cols).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    for encode, qtype, bound in ((quantize_q4_k, gguf.GGMLQuantizationType.Q4_K, 0.1),
                                 (quantize_q6_k, gguf.GGMLQuantizationType.Q6_K, 0.03)):
        blocks = encode(x)
        assert blocks.shape == (rows, cols // 256 * {"Q4_K": 144, "Q6_K": 210}[qtype.name])
        back = gguf.quants.dequantize(blocks, qtype)
        assert np.linalg.norm(back - x) / np.linalg.norm(x) < bound, qtype.name
