"""Quantized weights: weight-only int8 (the CPU kernel against its references) and fp8 e4m3 (the
reference on the CPU, torch._scaled_mm on GPUs with fp8), and the engine end to end against the
same model with the dequantized weights written into an ordinary checkpoint.

Tolerances (relative error ||out - ref|| / ||ref||):
- kernel vs `int8_linear_kernel_arith_ref` (the kernel's own arithmetic: x rounded to int16 per
  row, integer products and sums, float32 scaling): float32 1e-5 (measured <= 1e-7 for K up to 512
  and up to 2.4e-6 beyond, where each 512-input chunk's int32 sum is rounded to float32 and the
  kernel's reciprocal of max|x| under -ffast-math can move an element of x by one int16 step),
  bfloat16 4e-3 (the one rounding of the output to bfloat16, 2^-9 per element, ~2^-10 on average).
- On CPUs with AMX, bfloat16 x of 16+ rows (even widths) runs on the tile unit, x unrounded: the
  definition's arithmetic up to float32 sum order, within the same bfloat16 bounds (its distance
  from the int16 arithmetic, <= 2^-16 of a row's largest value, is far inside 4e-3).
- kernel vs `int8_linear_ref` (the definition, x unrounded): float32 2e-4, bfloat16 1e-2. The int16
  rounding of x is at most 2^-16 of a row's largest value per element; random rows have a largest
  value ~3.5x their rms, which measured ~3e-5 in float32. A wrong channel, scale or block gives
  errors of order 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from streamer_kernels.fp8 import FP8, fp8_linear_ref, quantize_weight_fp8_ref
from streamer_kernels.int8_gemm import (
    dequantize_int8_ref,
    int8_linear_kernel_arith_ref,
    int8_linear_ref,
    pack_int8_weight,
    quantize_int8_ref,
    unpack_int8_weight,
)

from streamer import LLM, SamplingParams
from streamer.quantization.fp8 import Fp8Weight
from streamer.quantization.int8 import KERNEL_MAX_ROWS, TILE_UNIT_MAX_ROWS, Int8Weight

ARITH_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
REF_TOL = {torch.float32: 2e-4, torch.bfloat16: 1e-2}
# (rows, out, in): decode batch sizes 1-16 (tails of the 4-row tiles and of the 8-block groups),
# output widths off the 16-channel blocks, odd inputs (padded pair), K past one 512-input chunk.
SHAPES = [(1, 16, 32), (3, 17, 5), (4, 100, 333), (5, 129, 64), (8, 576, 576), (13, 200, 1100), (16, 48, 1536)]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _kernel():
    from streamer_kernels.cpu_extension import load
    from streamer_kernels.int8_gemm_cpu import int8_linear_cpu

    assert load() is not None, "the CPU kernels must build here"
    return int8_linear_cpu


def test_quantize_and_pack_round_trip() -> None:
    w = torch.randn(37, 19) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different ranges
    w[5] = 0  # a zero row: scale 1, q 0
    q, scale = quantize_int8_ref(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale[5] == 1 and not q[5].any()
    # symmetric rounding: every weight within half a step of its row's scale
    assert ((dequantize_int8_ref(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-9).all()
    packed = pack_int8_weight(q)
    assert packed.shape == (3, 10, 16, 2)
    assert torch.equal(unpack_int8_weight(packed, 37, 19), q)
    assert not packed[2, :, 5:].any() and not packed[:, 9, :, 1].any()  # the padding is zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_kernel_matches_references(shape: tuple[int, int, int], bias: bool, dtype: torch.dtype) -> None:
    int8_linear_cpu = _kernel()
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    q, scale = quantize_int8_ref(w)
    out = int8_linear_cpu(x, pack_int8_weight(q), scale, b, n)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _rel(out, int8_linear_kernel_arith_ref(x, q, scale, b)) < ARITH_TOL[dtype]
    assert _rel(out, int8_linear_ref(x, q, scale, b)) < REF_TOL[dtype]


def test_int8_kernel_never_overflows_its_integer_sums() -> None:
    # The worst case: every product at its largest (127 * 32767) and of one sign over 4096 inputs;
    # without the float32 flush every 512 inputs an int32 sum would wrap.
    int8_linear_cpu = _kernel()
    k = 4096
    q, scale = torch.full((16, k), 127, dtype=torch.int8), torch.ones(16)
    x = torch.ones(2, k)
    out = int8_linear_cpu(x, pack_int8_weight(q), scale, None, 16)
    assert torch.allclose(out, torch.full((2, 16), 127.0 * k), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_kernel_rows_and_dense_rows(dtype: torch.dtype) -> None:
    """Decode-sized inputs take the kernel, prefill-sized ones the dequantized GEMM (bfloat16 rows on
    AMX: the kernel's tile unit up to TILE_UNIT_MAX_ROWS): all the reference."""
    _kernel()
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen).to(dtype)
    layer = Int8Weight.from_dense(w)
    assert layer.use_kernel and layer.weight.dtype == torch.int8 and layer.weight.numel() == 96 * 80
    q, scale = quantize_int8_ref(w)
    for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 300, TILE_UNIT_MAX_ROWS + 1):
        x = torch.randn(rows, 80, generator=gen).to(dtype)
        assert _rel(layer.apply(x, b), int8_linear_ref(x, q, scale, b)) < REF_TOL[dtype]
    x3 = torch.randn(2, 3, 80, generator=gen).to(dtype)  # leading dimensions kept
    assert layer.apply(x3, None).shape == (2, 3, 96)


def test_int8_tile_unit_takes_bfloat16_rows_where_the_cpu_has_amx() -> None:
    """On a CPU with AMX, bfloat16 x of 16+ rows and an even width runs on the tile unit against the
    weights widened to bfloat16: x unrounded, so within bfloat16's output rounding of the definition
    (and no closer to the int16 arithmetic than that). Elsewhere, and for float32 x, fewer rows or an
    odd width, the int16 path: the shapes above cover both on either kind of CPU."""
    from streamer_kernels.cpu_features import cpu_flags
    from streamer_kernels.int8_gemm_cpu import int8_linear_tile_unit

    int8_linear_cpu = _kernel()
    amx = {"amx_bf16", "amx_tile"} <= cpu_flags()
    gen = torch.Generator().manual_seed(9)
    for m, n, k in [(16, 70, 96), (40, 300, 1100), (300, 48, 64)]:
        x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen).bfloat16()
        q, scale = quantize_int8_ref(w)
        assert int8_linear_tile_unit(x) == amx
        assert _rel(int8_linear_cpu(x, pack_int8_weight(q), scale, b, n), int8_linear_ref(x, q, scale, b)) < 4e-3
    for x in (torch.randn(16, 96), torch.randn(15, 96).bfloat16(), torch.randn(16, 95).bfloat16()):
        assert not int8_linear_tile_unit(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weight_on_cpu_is_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(64, 48, generator=gen) * torch.logspace(-2, 1, 64)[:, None]
    q, scale = quantize_weight_fp8_ref(w)
    assert q.dtype == FP8 and torch.allclose(q.float().abs().amax(1), torch.full((64,), 448.0))
    back = q.float() * scale[:, None]
    assert ((back - w).abs() <= w.abs() * 2.0 ** -4 + scale[:, None] * 2.0 ** -10).all()  # e4m3's half-ulp
    layer = Fp8Weight.from_dense(w)
    x, b = torch.randn(5, 48, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    ref = fp8_linear_ref(x, q, scale, b)
    assert _rel(layer.apply(x, b), ref) < {torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype]
    assert _rel(ref.float(), torch.nn.functional.linear(x.float(), w, b.float())) < 0.05  # fp8's own cost


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="torch._scaled_mm needs a CUDA GPU with fp8 (compute capability 8.9+)")
def test_fp8_scaled_mm_matches_reference_on_gpu() -> None:
    from streamer_kernels.fp8_gemm_cuda import fp8_linear_scaled_mm

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(256, 512, generator=gen)
    q, scale = quantize_weight_fp8_ref(w)
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
    b = torch.randn(256, generator=gen).to(torch.bfloat16)
    out = fp8_linear_scaled_mm(x.cuda(), q.cuda(), scale.cuda(), b.cuda())
    # The activations are quantized to e4m3 too (2^-4 half-ulp per value): ~3% of the output's norm
    assert _rel(out.cpu().float(), fp8_linear_ref(x, q, scale, b).float()) < 0.06


def _dequantized_checkpoint(src: Path, dst: Path, method: str) -> Path:
    """`src` with every linear weight replaced by dequantize(quantize(weight)): the model the
    quantized engine stands for, as an ordinary float32 checkpoint."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    assert not json.loads((dst / "config.json").read_text())["tie_word_embeddings"]
    changed = 0
    for name, w in tensors.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            if method == "int8":
                tensors[name] = dequantize_int8_ref(*quantize_int8_ref(w)).to(w.dtype)
            else:
                q, scale = quantize_weight_fp8_ref(w)
                tensors[name] = (q.float() * scale[:, None]).to(w.dtype)
            changed += 1
    assert changed == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_engine_greedy_tokens_equal_the_dequantized_model(llama_ckpt: Path, tmp_path: Path, method: str) -> None:
    """float32, 8 prompts of 1-300 tokens decoded together (batch sizes 1-8 through the kernel,
    prefills through the dense path): the same greedy tokens as the dequantized checkpoint. int8
    differs from that model only by the kernel's int16 rounding of x (~3e-5 of a layer's output) and
    fp8 on the CPU not at all, so equality is expected; a wrong scale, channel or layer changes the
    tokens within a few steps."""
    from parity import MAX_TOKENS, parity_prompts

    _kernel()
    reference = _dequantized_checkpoint(llama_ckpt, tmp_path / "deq", method)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts(512)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    options = dict(dtype="float32", device="cpu", num_kv_blocks=256, seed=0)
    with LLM(str(llama_ckpt), quantization=method, **options) as llm:
        layer = llm.engine.executor.model.layers[0].mlp.down_proj
        assert layer.weight.numel() == 0 and layer.packed.weight.dtype == {"int8": torch.int8, "fp8": FP8}[method]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(reference), **options) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert sum(map(len, got)) == sum(MAX_TOKENS)


def _compressed_tensors_checkpoint(src: Path, dst: Path) -> Path:
    """`src` as compressed-tensors writes a W8A16 (int-quantized, per-channel, symmetric) model:
    `weight` int8, `weight_scale` [out, 1], `weight_zero_point` zeros, and its quantization_config."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight") or n == "lm_head.weight"]:
        q, scale = quantize_int8_ref(tensors[name])
        tensors[name] = q
        tensors[name + "_scale"] = scale[:, None].to(torch.bfloat16).float()  # stored in the model's dtype
        tensors[name + "_zero_point"] = torch.zeros(q.shape[0], 1, dtype=torch.int8)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "observer": "minmax"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},
        "ignore": [], "kv_cache_scheme": None}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_compressed_tensors_int8_checkpoint_keeps_its_values(llama_ckpt: Path, tmp_path: Path) -> None:
    """The checkpoint's int8 values and scales, loaded as they are, give the tokens of the dense
    checkpoint with those same values (its scales rounded to bfloat16, as stored) dequantized."""
    from parity import MAX_TOKENS, parity_prompts

    from streamer.errors import ConfigError

    _kernel()
    ct = _compressed_tensors_checkpoint(llama_ckpt, tmp_path / "ct")
    tensors = load_file(str(ct / "model.safetensors"))
    deq = {n: t for n, t in tensors.items() if not n.endswith(("_scale", "_zero_point"))}
    for name in [n for n in deq if deq[n].dtype == torch.int8]:
        deq[name] = dequantize_int8_ref(deq[name], tensors[name + "_scale"].flatten())
    shutil.copytree(llama_ckpt, tmp_path / "deq")
    save_file(deq, str(tmp_path / "deq" / "model.safetensors"), metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": p} for p in parity_prompts(512)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    options = dict(dtype="float32", device="cpu", num_kv_blocks=256, seed=0)
    with LLM(str(ct), **options) as llm:
        qkv = llm.engine.executor.model.layers[1].self_attn.qkv_proj
        assert isinstance(qkv.packed, Int8Weight) and qkv.weight.numel() == 0
        want_q = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv.packed.int8(), want_q)  # the file's values, not requantized
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(tmp_path / "deq"), **options) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="pack-quantized"):
        LLM(str(ct), **options)
