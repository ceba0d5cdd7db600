"""The compiled CPU decode kernel against its reference, on fresh random inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testing import make_paged_kv, query_start_loc, rel_err
from streamer_kernels.cpu_attention import (
    load,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    prefill_products,
)
from streamer_kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref

from streamer.attention.cpu_backend import CpuBackend

# Relative error ||out - ref|| / ||ref||. float32: both accumulate in float32, in a different
# order, so ~1e-6. bfloat16: inputs are identical, but the kernel accumulates in float32 and
# rounds once while the reference (SDPA) rounds intermediate results to bfloat16: 1e-2 covers
# that (bf16 has 8 mantissa bits, ~4e-3 per rounding).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def test_kernel_builds_here():
    assert load() is not None, "the C++ decode kernel must compile on this machine (g++ and ninja are installed)"


@pytest.mark.parametrize("batch, heads, kv_heads, head_size, block_size, max_len", [
    (1, 4, 4, 64, 16, 1),
    (5, 4, 1, 64, 8, 37),      # GQA 4, lengths not a multiple of the block size
    (3, 8, 1, 128, 32, 301),   # GQA 8
    (7, 6, 6, 80, 16, 129),    # head size 80
    (2, 8, 2, 64, 64, 513),
    (4, 4, 2, 72, 16, 50),     # head size 72: not a multiple of the vector width (generic path)
    (9, 6, 3, 32, 16, 15),     # head size 32, every sequence shorter than one vector of positions
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(batch, heads, kv_heads, head_size, block_size, max_len, dtype):
    gen = torch.Generator().manual_seed(batch * 1000 + max_len)
    max_blocks = -(-max_len // block_size)
    num_blocks = batch * max_blocks + 5
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    # Shuffled block tables: sequences own scattered blocks.
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).int()
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = max_len
    query = torch.randn(batch, heads, head_size, generator=gen).to(dtype)
    scale = head_size ** -0.5
    ref = paged_decode_attention_ref(query.float(), key_cache.float(), value_cache.float(), tables, lens, scale)
    out = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ignores_slots_past_each_length(dtype):
    """Poison every slot past a sequence's length: the output must not change."""
    gen = torch.Generator().manual_seed(7)
    key_cache = torch.randn(8, 16, 2, 64, generator=gen).to(dtype)
    value_cache = torch.randn(8, 16, 2, 64, generator=gen).to(dtype)
    tables = torch.tensor([[3, 5, 1]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    query = torch.randn(1, 4, 64, generator=gen).to(dtype)
    before = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    key_cache[5, 4:] = 1e4
    value_cache[5, 4:] = float("nan")
    key_cache[1] = 1e4
    after = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    assert torch.equal(before, after)


# ---- prefill / extend: csrc/paged_prefill_cpu.cpp ---------------------------------------------
# A task is 96 query rows (positions x query heads per KV head) and keys go 64 at a time: the
# cases cross both boundaries, and cover every group size, head sizes that are not a multiple of
# the vector width (zero padded), block sizes, plain prompts, extends over cached context, one-
# token extends and all of them in one call.
PREFILL_CASES = [  # (heads, kv_heads, head_size, block_size, new tokens per sequence, sequence lengths)
    (12, 4, 64, 16, [300, 7], [300, 7]),             # GQA 3, prompts with nothing cached
    (8, 8, 64, 32, [40, 1, 65], [100, 33, 65]),      # MHA: extends over cached context, and a prompt
    (6, 2, 80, 16, [129], [200]),                     # head size 80
    (12, 4, 64, 16, [20, 9, 31, 1, 64], [212, 200, 231, 17, 64 + 130]),  # prefix-cache hits
    (8, 8, 64, 32, [300, 1200], [700, 1500]),        # long extends
    (6, 2, 80, 16, [150, 3, 65, 40], [150, 90, 400, 41]),
    (16, 2, 128, 8, [97, 33], [97, 161]),            # GQA 8, head size 128, block size 8
    (4, 4, 32, 16, [5, 200], [70, 200]),             # head size 32
    (8, 2, 72, 16, [50, 96], [50, 96 + 64]),         # head size 72
]
TOLERANCE_PREFILL = 1e-5  # float32: the same sums in another order (measured ~1e-7)


def _prefill_case(case: tuple, seed: int, dtype: torch.dtype = torch.float32) -> tuple:
    """The kernel's inputs (caches with NaN in every slot it must not read) and the reference's
    (the same caches with zeros there)."""
    heads, kv_heads, head_size, block_size, q_lens, seq_lens = case
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, kv_heads, head_size, block_size, dtype, "cpu", gen)
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype)
    return kv, kv.clean(), kv.block_tables, query_start_loc(q_lens, "cpu"), kv.seq_lens, query


def _dense_attention(query, key_cache, value_cache, tables, starts, seq_lens, scale):
    """Softmax(QK^T)V written out token by token from the block tables: the definition."""
    out = torch.empty_like(query)
    group = query.shape[1] // key_cache.shape[2]
    bs = key_cache.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = range(int(starts[b]), int(starts[b + 1]))
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(seq_len)]
        k = key_cache.flatten(0, 1)[slots].repeat_interleave(group, 1)  # [L, H, D]
        v = value_cache.flatten(0, 1)[slots].repeat_interleave(group, 1)
        for i, row in enumerate(rows):
            pos = seq_len - len(rows) + i
            w = torch.einsum("hd,lhd->hl", query[row], k[:pos + 1]) * scale
            out[row] = torch.einsum("hl,lhd->hd", w.softmax(-1), v[:pos + 1])
    return out


@pytest.mark.parametrize("case", PREFILL_CASES[:3])
def test_prefill_reference_is_causal_attention_over_the_cache(case):
    _, (key_cache, value_cache), tables, starts, seq_lens, query = _prefill_case(case, seed=case[4][0])
    scale = case[2] ** -0.5
    ref = paged_prefill_attention_ref(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    dense = _dense_attention(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    assert ((ref - dense).norm() / dense.norm()).item() < 1e-5  # float32, different summation order


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_prefill_matches_reference(case):
    kv, (key_cache, value_cache), tables, starts, seq_lens, query = _prefill_case(case, seed=sum(case[4]))
    scale = case[2] ** -0.5
    ref = paged_prefill_attention_ref(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    out = paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert rel_err(out, ref) < TOLERANCE_PREFILL


def test_cpu_prefill_rows_are_causal():
    """Changing the key and value of position p may change only the rows at positions >= p."""
    case = (8, 2, 64, 16, [100], [160])  # 60 cached positions, then 100 new ones
    kv, _, tables, starts, seq_lens, query = _prefill_case(case, seed=3)
    before = paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125)
    p = 60 + 41  # the position of new row 41
    slot = int(tables[0, p // 16]) * 16 + p % 16
    kv.key_cache.view(-1, 2, 64)[slot] += 3.0
    kv.value_cache.view(-1, 2, 64)[slot] -= 3.0
    after = paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125)
    changed = (before - after).abs().amax(dim=(1, 2)) > 0
    assert not changed[:41].any() and changed[41:].all()


def test_cpu_prefill_works_on_a_slice_of_the_batch():
    """The backend passes the prefill rows after the decodes: offsets relative to their first."""
    case = PREFILL_CASES[3]
    kv, (key_cache, value_cache), tables, starts, seq_lens, query = _prefill_case(case, seed=5)
    scale = case[2] ** -0.5
    shifted = starts + 7  # as if 7 decode rows came first
    ref = paged_prefill_attention_ref(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    out = paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, shifted, seq_lens, scale)
    assert rel_err(out, ref) < TOLERANCE_PREFILL


BF16_PRODUCTS = ["float32", "bf16_dot", "amx"]


@pytest.mark.parametrize("products", BF16_PRODUCTS)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_prefill_in_bfloat16_is_as_close_to_float32_as_the_reference(case, products):
    """bfloat16: both sides read the same rounded inputs. Measured against float32 attention of
    the same inputs, the kernel's error must stay within the reference's (SDPA in bfloat16:
    1.8-2.3e-3 here, about one bfloat16 rounding of the output) plus 1e-3. Every product path:
    float32 (any CPU; rounds once, ~1.6e-3), and the two that round the softmax weights to
    bfloat16 as the reference does (the same error as the reference, measured 1.85-2.2e-3):
    vdpbf16ps on CPUs with AVX-512 BF16, the AMX tiles on CPUs with AMX. On a CPU without
    one, asking for it must fail clearly instead of computing something else."""
    kv, (key_cache, value_cache), tables, starts, seq_lens, query = _prefill_case(
        case, seed=sum(case[4]) + 1, dtype=torch.bfloat16)
    scale = case[2] ** -0.5
    def run() -> torch.Tensor:
        return paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, scale,
                                           products=products)

    if products not in prefill_products(torch.bfloat16):
        with pytest.raises(RuntimeError, match="do not run on this CPU"):
            run()
        return
    truth = paged_prefill_attention_ref(query.float(), key_cache.float(), value_cache.float(), tables, starts,
                                        seq_lens, scale)
    ref = paged_prefill_attention_ref(query, key_cache, value_cache, tables, starts, seq_lens, scale)
    out = run()
    assert out.dtype == torch.bfloat16
    assert rel_err(out, truth) < 1.0 * rel_err(ref, truth) + 1e-3, (rel_err(out, truth), rel_err(ref, truth))


def test_cpu_prefill_products_follow_the_cpu():
    """What runs where: float32 products everywhere, vdpbf16ps exactly where /proc/cpuinfo shows
    AVX-512 BF16, the AMX tiles where it shows AMX-BF16; float32 inputs only on float32."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert prefill_products(torch.float32) == ["float32"]
    expected = ["float32"] + ["bf16_dot"] * ("avx512_bf16" in flags) + ["amx"] * ("amx_bf16" in flags)
    assert prefill_products(torch.bfloat16) == expected
    kv, _, tables, starts, seq_lens, query = _prefill_case(PREFILL_CASES[0], seed=1)
    with pytest.raises(RuntimeError, match="products: auto, float32, bf16_dot or amx, not fast"):
        paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125,
                                    products="fast")


def test_cpu_prefill_takes_the_fastest_bfloat16_products_of_the_cpu():
    """The backend's bfloat16 prefill runs the AMX tiles where the CPU has them (1.9x the float32
    products there, 2.9x vdpbf16ps), else vdpbf16ps (1.5x the float32 products on Zen 4), else
    float32 products: the paths round differently, so the backend's output is bit-equal to the
    chosen one's and differs from the float32 path's exactly where a faster one exists."""
    case = PREFILL_CASES[0]
    kv, _, tables, starts, seq_lens, query = _prefill_case(case, seed=11, dtype=torch.bfloat16)
    backend = torch.empty_like(query)
    CpuBackend().prefill(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125, 300, backend)
    fastest = prefill_products(torch.bfloat16)[-1]
    chosen, f32 = (paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125,
                                               products=p) for p in (fastest, "float32"))
    assert torch.equal(backend, chosen)
    assert torch.equal(backend, f32) == (fastest == "float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_is_one_compiled_call(dtype):
    """The backend's prefill is the compiled kernel alone: no ATen attention (its "math" path
    cost 4-5x at long prompts), no K/V gather, no mask, no per-sequence Python loop of ops."""
    case = PREFILL_CASES[3]
    kv, _, tables, starts, seq_lens, query = _prefill_case(case, seed=1, dtype=dtype)
    out = torch.empty_like(query)
    with torch.profiler.profile() as prof:
        CpuBackend().prefill(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125, 64, out)
    names = [e.name for e in prof.events()]
    assert names and not [n for n in names if any(w in n for w in ("attention", "bmm", "softmax", "index", "gather",
                                                                     "matmul", "repeat"))], names
    assert len(names) <= 6, names  # the int32 views and the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_reads_strided_query_rows_in_place_and_writes_into_out(dtype):
    """The model passes q as a view of the fused QKV output (token rows strided) and the backend
    a slice of its output: both are used in place, with the results of a dense query, bit for bit."""
    case = PREFILL_CASES[3]
    kv, _, tables, starts, seq_lens, query = _prefill_case(case, seed=9, dtype=dtype)
    t, heads, d = query.shape
    fused = torch.randn(t, (heads + 2 * case[1]) * d).to(dtype)
    fused[:, :heads * d] = query.reshape(t, -1)
    strided = fused[:, :heads * d].view(t, heads, d)
    assert not strided.is_contiguous()
    dense = paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125)
    out = torch.full((t + 3, heads, d), float("nan"), dtype=dtype)
    with torch.profiler.profile() as prof:
        got = paged_prefill_attention_cpu(strided, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125,
                                          out=out[3:])
    assert got.data_ptr() == out[3:].data_ptr() and torch.equal(out[3:], dense)
    assert out[:3].isnan().all()  # nothing written outside `out`
    assert not [e.name for e in prof.events() if "copy" in e.name or "contiguous" in e.name]


def test_cpu_prefill_rejects_an_out_it_cannot_fill():
    case = PREFILL_CASES[0]
    kv, _, tables, starts, seq_lens, query = _prefill_case(case, seed=4)
    for out in (torch.empty_like(query)[:-1], torch.empty_like(query, dtype=torch.bfloat16),
                torch.empty(query.shape[::-1]).transpose(0, 2)):
        with pytest.raises(RuntimeError, match="out must"):
            paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125, out=out)


def test_cpu_prefill_rejects_inconsistent_shapes():
    case = PREFILL_CASES[0]
    kv, _, tables, starts, seq_lens, query = _prefill_case(case, seed=2)
    with pytest.raises(RuntimeError, match="exceed"):  # more new tokens than the sequence has
        paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables, starts, seq_lens - 1, 0.125)
    with pytest.raises(RuntimeError, match="exceed"):  # a length past the block table
        paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, tables[:, :1], starts, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="cover"):
        paged_prefill_attention_cpu(query[:-1], kv.key_cache, kv.value_cache, tables, starts, seq_lens, 0.125)


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load(tmp_path):
    """torch's build lock is a plain file; a worker killed while compiling leaves it behind."""
    from streamer_kernels.cpu_extension import build_directory

    load()
    (build_directory() / "lock").touch()
    code = "from streamer_kernels.cpu_extension import load; print(load() is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_second_checkout_of_the_same_sources_reuses_the_build(tmp_path):
    """The build is keyed by the sources' content and the flags, not their path: a copy of kernels/
    elsewhere (another clone) finds the first checkout's build and compiles nothing."""
    import shutil

    load()
    clone = tmp_path / "elsewhere" / "kernels"
    shutil.copytree(Path(__file__).resolve().parents[2] / "kernels", clone,
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = """
import importlib.util, logging, sys, time
logging.basicConfig(level=logging.WARNING, format="%(message)s")
spec = importlib.util.spec_from_file_location("cloned_cpu_extension", sys.argv[1])
cloned = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cloned)
from streamer_kernels import cpu_extension
start = time.monotonic()
built = cloned.load()
print(cloned.build_directory() == cpu_extension.build_directory(), built is not None, time.monotonic() - start)
"""
    out = subprocess.run([sys.executable, "-c", code, str(clone / "cpu_extension.py")], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    same_dir, loaded, seconds = out.stdout.split()
    assert (same_dir, loaded) == ("True", "True"), out.stderr[-2000:]
    assert "compiling" not in out.stderr, out.stderr[-2000:]
    assert float(seconds) < 30
