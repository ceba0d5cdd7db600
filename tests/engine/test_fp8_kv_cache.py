"""The fp8 (e4m3) KV cache: the references, the CPU kernels and the Triton kernels that read it,
its sizing (half the bytes, twice the blocks) and the engine end to end.

Tolerances. Every kernel reads the same fp8 bytes as the reference and widens them exactly (e4m3
fits float32), times the same float32 scale: they differ only where the reference rounds the
widened values to the query's dtype before attending (bfloat16: 2^-9 relative per value) and in
the order of float32 sums, so the attention tolerances of the float caches apply (ATTN_TOL,
tests/kernel_testing.py). The cache writes are exact: the same rounding (nearest even, saturated
at 448) of the same float32 quotient.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICES, make_paged_kv, query_start_loc, randn, rel_err
from streamer_kernels.cache_ops import reshape_and_cache_ref
from streamer_kernels.fp8 import FP8, FP8_MAX, dequantize_fp8_ref, quantize_fp8_ref
from streamer_kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref

from streamer.kv_cache_dtype import K_SCALE_RANGE, V_SCALE_RANGE, cache_dtype, calibrated_scales
from streamer.kv_cache_sizing import bytes_per_block, cpu_kv_blocks

# (query heads, kv heads, head size, block size, context lengths)
CASES = [(4, 4, 64, 16, [1, 17, 40]), (8, 2, 64, 8, [33, 5, 64, 20]), (6, 2, 128, 32, [70, 3])]
SCALES = [(1.0, 1.0), (0.02, 0.05)]  # vLLM's default, and calibrated-looking scales


def _fp8_kv(case: tuple, device: str, k_scale: float, v_scale: float, seed: int):
    """Random K/V spanning fp8's subnormals to its top (each row times 2^-12..2^7), quantized; the
    poison (NaN) stays NaN in e4m3, so a kernel that reads it still turns its output NaN."""
    heads, kv_heads, head_size, block_size, seq_lens = case
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, kv_heads, head_size, block_size, torch.float32, device, gen)
    spread = 2.0 ** torch.randint(-12, 8, kv.key_cache.shape[:3] + (1,), generator=gen).to(device)
    keys = quantize_fp8_ref(kv.key_cache * spread * k_scale, k_scale)
    values = quantize_fp8_ref(kv.value_cache * spread.flip(0) * v_scale, v_scale)
    clean = (quantize_fp8_ref((kv.key_cache * spread * k_scale).nan_to_num(0.0), k_scale),
             quantize_fp8_ref((kv.value_cache * spread.flip(0) * v_scale).nan_to_num(0.0), v_scale))
    return kv, keys, values, clean


def test_quantize_round_trip_error_and_saturation() -> None:
    x = torch.randn(4096) * 10
    scale = 0.05
    back = dequantize_fp8_ref(quantize_fp8_ref(x, scale), scale, torch.float32)
    inside = x.abs() / scale <= FP8_MAX
    normal = inside & (x.abs() / scale >= 2.0 ** -6)  # e4m3's smallest normal
    # 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals are spaced 2^-9 (times the scale)
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -4 + 1e-7).all()
    assert ((back - x).abs()[~normal & inside] <= scale * 2.0 ** -10 + 1e-9).all()
    assert (back[~inside].abs() == FP8_MAX * scale).all() and (~inside).any()  # saturated
    big = quantize_fp8_ref(torch.tensor([1e6, -1e6, float("nan")]), 1.0).float()
    assert big[:2].tolist() == [FP8_MAX, -FP8_MAX] and big[2].isnan()  # saturated, not NaN; NaN stays


def test_sizing_half_the_bytes_twice_the_blocks() -> None:
    bf16 = bytes_per_block(16, 8, 128, 32, torch.bfloat16.itemsize)
    fp8 = bytes_per_block(16, 8, 128, 32, cache_dtype("fp8", torch.bfloat16).itemsize)
    assert bf16 == 2 * 16 * 8 * 128 * 32 * 2 and fp8 * 2 == bf16
    gib = 1 << 30
    assert cpu_kv_blocks(gib, 8 * gib, 1, fp8, 10**9) == 2 * cpu_kv_blocks(gib, 8 * gib, 1, bf16, 10**9)
    assert cache_dtype("auto", torch.float32) == torch.float32 and cache_dtype("fp8_e4m3", torch.float32) == FP8


def test_calibrated_scales_as_vllm() -> None:
    k, v = torch.randn(5, 2, 8) * 3, torch.randn(5, 2, 8)
    ks, vs = calibrated_scales(k, v)
    assert ks == pytest.approx(float(k.abs().max()) / K_SCALE_RANGE)
    assert vs == pytest.approx(float(v.abs().max()) / V_SCALE_RANGE)
    assert calibrated_scales(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)) == (1.0, 1.0)


def test_reference_cache_write_quantizes_and_attention_stays_close() -> None:
    # The accuracy cost of the format itself: fp8 K/V against the float32 cache they came from.
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([40, 9], 2, 64, 16, torch.float32, "cpu", gen)
    keys, values = kv.clean()
    slots = torch.arange(keys.shape[0] * keys.shape[1])
    fp8_k, fp8_v = torch.zeros(keys.shape, dtype=FP8), torch.zeros(keys.shape, dtype=FP8)
    reshape_and_cache_ref(keys.view(-1, 2, 64), values.view(-1, 2, 64), fp8_k, fp8_v, slots, 0.01, 0.02)
    assert torch.equal(fp8_k.view(torch.uint8), quantize_fp8_ref(keys, 0.01).view(torch.uint8))
    query = randn(2, 4, 64, dtype=torch.float32, device="cpu", gen=gen)
    exact = paged_decode_attention_ref(query, keys, values, kv.block_tables, kv.seq_lens, 0.125)
    fp8 = paged_decode_attention_ref(query, fp8_k, fp8_v, kv.block_tables, kv.seq_lens, 0.125, k_scale=0.01,
                                     v_scale=0.02)
    assert 0 < rel_err(fp8, exact) < 0.05  # measured ~0.02-0.03: e4m3's 2^-4 half-ulp, averaged


def _cpu_backend():
    from streamer_kernels.cpu_extension import load

    from streamer.attention.cpu_backend import CpuBackend

    assert load() is not None, "the CPU kernels must build here"
    return CpuBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("case", CASES)
def test_cpu_decode_reads_fp8_cache(case: tuple, scales: tuple, dtype: torch.dtype) -> None:
    from streamer_kernels.cpu_attention import paged_decode_attention_cpu

    _cpu_backend()
    kv, keys, values, clean = _fp8_kv(case, "cpu", *scales, seed=case[2] + len(case[4]))
    query = randn(len(case[4]), case[0], case[2], dtype=dtype, device="cpu", gen=torch.Generator().manual_seed(1))
    ref = paged_decode_attention_ref(query, *clean, kv.block_tables, kv.seq_lens, case[2] ** -0.5,
                                     k_scale=scales[0], v_scale=scales[1])
    out = paged_decode_attention_cpu(query, keys, values, kv.block_tables, kv.seq_lens, case[2] ** -0.5,
                                     k_scale=scales[0], v_scale=scales[1])
    assert rel_err(out, ref) < ATTN_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backend_prefill_and_write_over_fp8_cache(case: tuple, dtype: torch.dtype) -> None:
    from streamer.attention.backend import AttentionMetadata

    backend = _cpu_backend()
    heads, kv_heads, head_size, _, seq_lens = case
    k_scale, v_scale = SCALES[1]
    kv, keys, values, clean = _fp8_kv(case, "cpu", k_scale, v_scale, seed=11)
    gen = torch.Generator().manual_seed(5)
    q_lens = [min(n, 7) for n in seq_lens]  # extends over cached context, and whole short prompts
    query = randn(sum(q_lens), heads, head_size, dtype=dtype, device="cpu", gen=gen)
    qsl = query_start_loc(q_lens, "cpu")
    out = torch.full_like(query, float("nan"))
    backend.prefill(query, keys, values, kv.block_tables, qsl, kv.seq_lens, head_size ** -0.5, max(q_lens), out,
                    k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_attention_ref(query, *clean, kv.block_tables, qsl, kv.seq_lens, head_size ** -0.5,
                                      k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out, ref) < ATTN_TOL[dtype]
    # the write: quantized rows copied into their slots, byte for byte the reference's
    new_k = randn(3, kv_heads, head_size, dtype=dtype, device="cpu", gen=gen)
    new_v = randn(3, kv_heads, head_size, dtype=dtype, device="cpu", gen=gen)
    slots = torch.tensor([0, 5, 2 * case[3] + 1])
    meta = AttentionMetadata(0, qsl, kv.seq_lens, slots, kv.block_tables, 1, 1, 1)
    mine, theirs = (clean[0].clone(), clean[1].clone()), (clean[0].clone(), clean[1].clone())
    backend.write_kv(new_k, new_v, *mine, meta, k_scale, v_scale)
    reshape_and_cache_ref(new_k, new_v, *theirs, slots, k_scale, v_scale)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_read_and_write_fp8_cache(device: str, dtype: torch.dtype) -> None:
    from streamer_kernels.cache_ops_triton import reshape_and_cache
    from streamer_kernels.paged_decode_triton import paged_decode_attention
    from streamer_kernels.paged_prefill_triton import paged_prefill_attention

    case = CASES[1]
    heads, kv_heads, head_size, _, seq_lens = case
    k_scale, v_scale = SCALES[1]
    kv, keys, values, clean = _fp8_kv(case, device, k_scale, v_scale, seed=21)
    gen = torch.Generator().manual_seed(8)
    scale = head_size ** -0.5
    query = randn(len(seq_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, keys, values, kv.block_tables, kv.seq_lens, scale, max(seq_lens), out=out,
                           num_splits=1, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(query, *clean, kv.block_tables, kv.seq_lens, scale, k_scale=k_scale,
                                     v_scale=v_scale)
    assert rel_err(out, ref) < ATTN_TOL[dtype]
    q_lens = [3, 5, 1, 4]
    pq = randn(sum(q_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    qsl = query_start_loc(q_lens, device)
    pout = paged_prefill_attention(pq, keys, values, kv.block_tables, qsl, kv.seq_lens, scale, max(q_lens),
                                   k_scale=k_scale, v_scale=v_scale)
    pref = paged_prefill_attention_ref(pq, *clean, kv.block_tables, qsl, kv.seq_lens, scale, k_scale=k_scale,
                                       v_scale=v_scale)
    assert rel_err(pout, pref) < ATTN_TOL[dtype]
    new_k = randn(4, kv_heads, head_size, dtype=dtype, device=device, gen=gen) * 3
    # values from fp8's subnormals to past its top: rounding, the carry into the exponent, saturation, -0
    new_v = randn(4, kv_heads, head_size, dtype=dtype, device=device, gen=gen) * torch.logspace(
        -7, 2, 4, device=device)[:, None, None].to(dtype)
    slots = torch.tensor([1, 9, 0, 30], device=device)
    mine, theirs = (clean[0].clone(), clean[1].clone()), (clean[0].clone(), clean[1].clone())
    reshape_and_cache(new_k, new_v, *mine, slots, k_scale, v_scale)
    reshape_and_cache_ref(new_k, new_v, *theirs, slots, k_scale, v_scale)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, theirs))


def _greedy(ckpt, **options) -> tuple[list[list[int]], object]:  # noqa: ANN001
    from parity import MAX_TOKENS, parity_prompts

    from streamer import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in parity_prompts(512)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(str(ckpt), device="cpu", seed=0, **options) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        attn = llm.engine.executor.model.layers[0].self_attn.attn
        return tokens, (attn.key_cache.dtype, attn.k_scale, attn.v_scale, llm.engine.executor.num_kv_blocks)


def test_engine_fp8_cache_kernels_equal_references_and_capacity_doubles(llama_ckpt) -> None:  # noqa: ANN001
    """float32 model, 8 prompts of 1-300 tokens decoded together: the CPU backend (decode kernel on
    fp8 rows, prefill on dequantized blocks) and the torch backend (the references) write the same
    fp8 bytes and read them alike, so the greedy tokens are equal; against the float32 cache they
    may part after a while (fp8's rounding), which is measured in bench/README.md, not asserted."""
    _cpu_backend()
    fp8 = dict(dtype="float32", num_kv_blocks=256, kv_cache_dtype="fp8")
    kernels, (dtype, k_scale, _, _) = _greedy(llama_ckpt, attention_backend="cpu", **fp8)
    references, _ = _greedy(llama_ckpt, attention_backend="torch", **fp8)
    assert dtype == FP8 and k_scale == 1.0
    assert kernels == references
    exact, _ = _greedy(llama_ckpt, dtype="float32", num_kv_blocks=256)
    first = sum(a[0] == b[0] for a, b in zip(kernels, exact))
    assert first >= 6, f"only {first}/8 first tokens equal the float32 cache's: fp8 K/V read wrongly?"
    # the same memory, twice the blocks of a bfloat16 cache
    _, (_, _, _, bf16_blocks) = _greedy(llama_ckpt, dtype="bfloat16", kv_cache_memory_gb=0.004)
    _, (_, _, _, fp8_blocks) = _greedy(llama_ckpt, dtype="bfloat16", kv_cache_memory_gb=0.004, kv_cache_dtype="fp8")
    assert fp8_blocks in (2 * bf16_blocks, 2 * bf16_blocks + 1)  # each the floor of budget / bytes per block


def test_engine_calibrates_kv_scales_on_its_first_forward(llama_ckpt) -> None:  # noqa: ANN001
    """Each layer's scales are max|k| / 200 and max|v| / 100 of its first forward's keys and values
    (vLLM's calculate_kv_scales), read here from the same first step of a float32-cache engine, and
    computed once."""
    from streamer import LLM, SamplingParams

    _cpu_backend()
    firsts: list[tuple[float, float]] = []
    with LLM(str(llama_ckpt), device="cpu", dtype="float32", num_kv_blocks=256, seed=0) as llm:
        backend = llm.engine.executor.backend
        write = backend.write_kv

        def recording(key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if len(firsts) < len(llm.engine.executor.model.layers):
                firsts.append((float(key.abs().max()), float(value.abs().max())))
            return write(key, value, *args, **kwargs)

        backend.write_kv = recording
        llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 77, 41]}], SamplingParams(max_tokens=2, temperature=0.0))
    with LLM(str(llama_ckpt), device="cpu", dtype="float32", num_kv_blocks=256, seed=0, kv_cache_dtype="fp8",
             calculate_kv_scales=True) as llm:
        layers = [layer.self_attn.attn for layer in llm.engine.executor.model.layers]
        assert all(a.calibrate_kv_scales and a.k_scale == 1.0 for a in layers)  # armed, not yet run
        llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 77, 41]}], SamplingParams(max_tokens=4, temperature=0.0))
        got = [(a.k_scale, a.v_scale) for a in layers]
        assert not any(a.calibrate_kv_scales for a in layers)  # once only
    want = [(k / K_SCALE_RANGE, v / V_SCALE_RANGE) for k, v in firsts]
    # layer 0's keys are the same numbers in both engines; a later layer's come after attention over
    # the fp8 cache, a few percent off the float32 cache's at most
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert all(g == pytest.approx(w, rel=0.1) for g, w in zip(got[1:], want[1:]))
    assert all(g[0] != 1.0 and g[1] != 1.0 for g in got)
