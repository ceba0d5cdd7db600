"""`--model path/to/model.gguf`: llama.cpp files of Llama, Qwen2, Qwen3, Gemma 2 and Gemma 3 (written
by the tests from random checkpoints, tests/gguf_files.py) converted once into a checkpoint directory,
whose greedy tokens equal transformers' on the original weights (F32), or on the file's own weights
(F16 stored as float16, Q8_0 and K-quants de-quantized), with the file's tokenizer and chat template.
For Gemma, the conversion also takes from the file what transformers' GGUF reader leaves out
(workers/gguf_metadata.py): without it, greedy tokens differ from the original's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf_files import (
    GEMMA_CHAT_TEMPLATE,
    llama3_rope_freqs,
    quantize_q4_k,
    quantize_q6_k,
    use_gemma_tokenizer,
    write_gguf,
)
from kernel_testing import rel_err
from parity import hf_greedy, parity_prompts
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from streamer import LLM, SamplingParams
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint, build_tokenizer
from workers.default_model import gguf_model_dir, resolve_model
from workers.errors import ModelNotFound, UnsupportedModel
from workers.gguf_metadata import complete_config, llama3_rope

SPECS = {
    "llama": TinyModelSpec(arch="llama"),
    "qwen2": TinyModelSpec(arch="qwen2", tie_word_embeddings=True),
    # transformers reads no head size from a Qwen3 GGUF (it takes Qwen3's 128): so is this one's.
    "qwen3": TinyModelSpec(arch="qwen3", extra={"head_dim": 128}),
    # A linear RoPE scaling, which the file stores and transformers' reader does not read.
    "llama_linear": TinyModelSpec(arch="llama", extra={
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    # Llama 3.1's scaling, which llama.cpp stores as the rope_freqs tensor: with head size 16 and these
    # bounds (wavelengths 64 and 1024), two of the 8 frequencies lie between them.
    "llama3": TinyModelSpec(arch="llama", extra={"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
        "original_max_position_embeddings": 1024, "rope_theta": 10000.0}}),
    # K-quants pack 256 values a block: every weight row a multiple of that.
    "llama256": TinyModelSpec(arch="llama", hidden_size=256, intermediate_size=512),
    # What a Gemma GGUF file cannot say is what llama.cpp assumes: the query scale of head_dim, the
    # sliding pattern (5 sliding layers, then a global one). The soft-caps, the window and Gemma 3's
    # linear RoPE scaling of its global layers are in the file, each unlike transformers' default.
    "gemma2": TinyModelSpec(arch="gemma2", tie_word_embeddings=True, extra={
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24,
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}),
    "gemma3": TinyModelSpec(arch="gemma3_text", num_hidden_layers=6, tie_word_embeddings=True, extra={
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
    "gemma3_256": TinyModelSpec(arch="gemma3_text", hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                tie_word_embeddings=True, extra={"head_dim": 64, "query_pre_attn_scalar": 64,
                                                                 "sliding_window": 24}),
}
BUDGETS = (10, 6, 8)
# What transformers' GGUF reader leaves at its config defaults (workers/gguf_metadata.py).
_NOT_READ_BY_TRANSFORMERS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                             "rope_parameters")


def _prompts() -> list[list[int]]:
    return parity_prompts(512, seed=12)[2:5]


def _greedy(model_dir: Path) -> list[list[int]]:
    """Every budgeted token (ignoring eos: a converted file may end generations at more tokens than
    the original checkpoint, compared in test_gemma_gguf_settings_come_from_the_file)."""
    llm = LLM(str(_byte_level(model_dir)), dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in BUDGETS])
    return [o.outputs[0].token_ids for o in outs]


def _byte_level(model_dir: Path) -> Path:
    """`model_dir` itself, or for a byte-fallback (Gemma) tokenizer a copy of its config and weights
    with a byte-level tokenizer of the same size: the token ids compared do not depend on it, and
    the engine's incremental detokenizer (tokenizers' DecodeStream) raises "Invalid prefix" on
    the random byte tokens a random model emits (a byte decoded alone, then as part of an invalid
    run, reads differently), which has nothing to do with the file."""
    if not json.loads((model_dir / "tokenizer.json").read_text())["model"].get("byte_fallback"):
        return model_dir
    copy = model_dir.parent.parent / f"{model_dir.name}-byte-level"  # beside the cache's models/
    if not copy.exists():
        copy.mkdir()
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(model_dir / name, copy / name)
        build_tokenizer(json.loads((model_dir / "config.json").read_text())["vocab_size"], copy)
    return copy


def _hf_greedy(ckpt: Path) -> list[list[int]]:
    return hf_greedy(ckpt, tuple(map(tuple, _prompts())), BUDGETS, ignore_eos=True)


def _transformers_reading(gguf: Path, ckpt: Path, dtype: torch.dtype, out: Path) -> Path:
    """transformers' own load of `gguf` (from_pretrained(gguf_file=...): its de-quantizer, Gemma's
    1 + w norms back to w) in `dtype`, saved to `out`. Given, as a user would have to, what its
    reader does not take from a Gemma file: the original checkpoint's values, not the conversion's."""
    from transformers import AutoModelForCausalLM

    original = json.loads((ckpt / "config.json").read_text())
    settings = {k: original[k] for k in _NOT_READ_BY_TRANSFORMERS if k in original}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype, **settings)
    # save_pretrained refuses a model loaded from GGUF: its weights and config as a checkpoint.
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    out.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(out))
    return out


def _convert(tmp_path: Path, arch: str, weight_type: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "cache"))
    ckpt = build_checkpoint(tmp_path / arch, SPECS[arch], seed=4)
    if arch.startswith("gemma"):
        use_gemma_tokenizer(ckpt)
    gguf = write_gguf(ckpt, tmp_path / f"{arch}.{weight_type}.gguf", weight_type)
    return ckpt, resolve_model(str(gguf), progress=lambda _msg: None)


@pytest.mark.parametrize("arch", ["llama", "llama_linear", "llama3", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_f32_gguf_equals_transformers_on_the_original(arch: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, model_dir = _convert(tmp_path, arch, "F32", monkeypatch)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == \
        json.loads((ckpt / "config.json").read_text())["architectures"]
    original, converted = load_file(str(ckpt / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert converted.keys() == original.keys()
    for k in converted:  # Llama's q/k rows put back; Gemma's 1 + w norms back to w, within float32's rounding
        atol = 2.4e-7 if arch.startswith("gemma") and k.endswith("norm.weight") else 0
        torch.testing.assert_close(converted[k], original[k], rtol=0, atol=atol)
    assert _greedy(model_dir) == _hf_greedy(ckpt)
    assert _greedy(model_dir) == _hf_greedy(_transformers_reading(tmp_path / f"{arch}.F32.gguf", ckpt, torch.float32,
                                                                    tmp_path / "hf"))
    text = "Héllo wörld: def main(): return [x * 2 for x in range(10)]"
    ours, theirs = AutoTokenizer.from_pretrained(str(model_dir)), AutoTokenizer.from_pretrained(str(ckpt))
    assert theirs.get_vocab().items() <= ours.get_vocab().items()  # transformers' reader may add <|endoftext|>
    assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
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
    ("gemma2", "F16", torch.float16, 1e-3),
    ("gemma3", "Q8_0", torch.bfloat16, 1e-2),
    # The Q4_K_M mix (Q4_K, Q6_K for output, attn_v, ffn_down): 4-bit blocks are ~8% off the original
    ("llama256", "Q4_K_M", torch.bfloat16, 0.1),
    ("gemma3_256", "Q4_K_M", torch.bfloat16, 0.1),
])
def test_quantized_gguf_runs_its_own_weights(arch: str, weight_type: str, dtype: torch.dtype, tolerance: float,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, model_dir = _convert(tmp_path, arch, weight_type, monkeypatch)
    original, converted = load_file(str(ckpt / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert {t.dtype for t in converted.values()} == {dtype}
    assert all(rel_err(converted[k], original[k]) < tolerance for k in converted)
    theirs = _transformers_reading(tmp_path / f"{arch}.{weight_type}.gguf", ckpt, dtype, tmp_path / "hf")
    theirs_weights = load_file(str(theirs / "model.safetensors"))
    assert theirs_weights.keys() == converted.keys()
    assert all(torch.equal(converted[k], theirs_weights[k]) for k in converted)
    assert _greedy(model_dir) == _hf_greedy(theirs)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_settings_come_from_the_file(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What transformers' reader leaves at its defaults (soft-caps 50/30, query scale 256, no RoPE
    scaling) is the original's, and chats end at <end_of_turn> as llama.cpp ends them (Gemma 3
    files declare only <eos>)."""
    ckpt, model_dir = _convert(tmp_path, arch, "F32", monkeypatch)
    original, converted = (json.loads((d / "config.json").read_text()) for d in (ckpt, model_dir))
    for key in ("head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "sliding_window", "layer_types", "rope_parameters"):
        assert converted.get(key) == original.get(key), key
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.chat_template == GEMMA_CHAT_TEMPLATE
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert tokenizer.decode(ids) == "<bos><start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n"
    ends = {tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>")}
    assert LLM(str(model_dir), dtype="float32", num_kv_blocks=16).engine.eos_token_ids == ends


@pytest.mark.parametrize("arch, layers, hidden, heads, head_dim, scalar", [
    ("gemma2", 42, 3584, 16, 256, 256),  # Gemma 2 9B
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads
    ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B: hidden / heads
])
def test_gemma_query_scale_is_llama_cpps(arch: str, layers: int, hidden: int, heads: int, head_dim: int,
                                         scalar: int) -> None:
    """A Gemma file does not store the query scale: llama.cpp's rule (head_dim, hidden / heads for the
    27B models, known by their layer count) gives each released model's query_pre_attn_scalar."""
    from transformers import AutoConfig

    config = AutoConfig.for_model({"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch], num_hidden_layers=layers,
                                  hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim)
    complete_config(config, {"general.architecture": arch, f"{arch}.attention.sliding_window": 4096})
    assert config.query_pre_attn_scalar == scalar


def test_gemma3_gguf_without_a_window_has_no_sliding_layers() -> None:
    """llama.cpp reads a Gemma 3 file without attention.sliding_window as global attention in every
    layer; transformers' reader would keep its 4096-token window on five layers of six."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=6, head_dim=16)
    complete_config(config, {"general.architecture": "gemma3"})
    assert (config.sliding_window, config.layer_types) == (None, ["full_attention"] * 6)


@pytest.mark.parametrize("head_dim, theta, factor", [(128, 500000.0, 8.0), (64, 500000.0, 32.0)])  # 3.1 8B, 3.2 1B
def test_llama3_rope_read_back_from_rope_freqs(head_dim: int, theta: float, factor: float) -> None:
    """The released Llama 3.1/3.2 RoPE parameters, from the rope_freqs tensor llama.cpp writes for them;
    a tensor with fewer than two frequencies between its bounds (here head size 16) is refused."""
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    factors = llama3_rope_freqs({"head_dim": head_dim, "rope_parameters": {**rope, "rope_theta": theta}})
    assert llama3_rope(Path("m.gguf"), factors.astype(float), theta) == rope
    small = llama3_rope_freqs({"head_dim": 16, "rope_parameters": {**rope, "rope_theta": 10000.0,
                                                                    "original_max_position_embeddings": 1024}})
    with pytest.raises(UnsupportedModel, match="rope_freqs tensor is not a Llama 3 RoPE scaling"):
        llama3_rope(Path("m.gguf"), small.astype(float), 10000.0)


def test_unsupported_gguf_architecture_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file of another architecture (here Gemma 1's, which transformers' reader cannot read)
    is refused before any conversion, naming the ones that are converted and what to do instead."""
    import gguf

    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "gemma-7b.gguf"), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel) as refused:
        resolve_model(str(tmp_path / "gemma-7b.gguf"), progress=lambda _msg: None)
    message = str(refused.value)
    assert "architecture 'gemma' is not supported" in message
    for supported in ("Llama (and Mistral) (llama)", "Qwen2/2.5 (qwen2)", "Qwen3 (qwen3)", "Gemma 2 (gemma2)",
                      "Gemma 3 (text) (gemma3)", "checkpoint directory (--model DIR)"):
        assert supported in message
    assert not any((tmp_path / "cache" / "models").iterdir())


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
