"""Sliding-window and soft-capped attention (Gemma, Mistral): the torch references against dense
attention spelled out position by position, and the compiled CPU kernels and the Triton kernels
against the references, with NaN in every key a kernel must not read: before each decode's
window exactly; for a prefill, the keys before the first window of its sequence's new tokens
(the CPU kernel reads whole 64/128-key tiles, so those before that tile's start)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICES, INTERPRET, make_paged_kv, query_start_loc, randn, rel_err
from streamer_kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu, prefill_products
from streamer_kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from streamer_kernels.paged_decode_triton import paged_decode_attention
from streamer_kernels.paged_prefill_triton import paged_prefill_attention

# (query heads, kv heads, head size, block size, context lengths, window): windows shorter than
# some contexts and longer than others; head size 24 takes the CPU decode kernel's generic path.
DECODE_CASES = [
    (4, 2, 64, 16, [1, 17, 40, 130], 32),
    (8, 1, 128, 8, [70, 3, 200], 50),
    (6, 3, 24, 16, [100, 9], 16),
    (4, 4, 64, 32, [300, 65], 100),
]
# ... plus the new tokens of each sequence (prompts, and extends over cached context).
PREFILL_CASES = [
    (4, 2, 64, 16, [40, 300, 129], [40, 100, 1], 32),
    (8, 1, 128, 8, [200, 64], [200, 10], 100),
    (4, 4, 32, 16, [400, 33], [150, 33], 130),
]
CPU_TILE = 128  # the largest key tile of the CPU prefill kernel (AMX)
SOFTCAP = 2.5  # small enough that capping changes the scores of unit-variance inputs


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: list[int],
                    scale: float, window: int, softcap: float) -> torch.Tensor:
    """Attention of `query` `[Lq, H, D]` at positions `q_pos` over `keys` `[L, KVH, D]` (positions
    0..L-1), in float64, one query row at a time over exactly the keys it sees: the definition the
    references follow."""
    q, k, v = query.double(), keys.double(), values.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # query head h reads h // group
    out = torch.empty_like(q)
    for i, p in enumerate(q_pos):
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,khd->hk", q[i], k[lo:p + 1]) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[lo:p + 1])
    return out


def _keys_of(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    bs = cache.shape[1]
    return cache[table[pos // bs].long(), pos % bs]


def _poison_before(kv, b: int, first: int) -> None:  # noqa: ANN001
    """NaN in sequence b's keys and values before position `first`."""
    bs = kv.key_cache.shape[1]
    for pos in range(first):
        blk = int(kv.block_tables[b, pos // bs])
        kv.key_cache[blk, pos % bs] = float("nan")
        kv.value_cache[blk, pos % bs] = float("nan")


def _decode_inputs(case: tuple, dtype: torch.dtype, device: str, seed: int):  # noqa: ANN202
    heads, kv_heads, head_size, block_size, seq_lens, window = case
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, kv_heads, head_size, block_size, dtype, device, gen)
    query = randn(len(seq_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    return kv, query


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_reference_is_windowed_attention(case: tuple, softcap: float) -> None:
    kv, query = _decode_inputs(case, torch.float32, "cpu", seed=1)
    head_size, window = case[2], case[5]
    key_cache, value_cache = kv.clean()
    ref = paged_decode_attention_ref(query, key_cache, value_cache, kv.block_tables, kv.seq_lens,
                                     head_size ** -0.5, window=window, softcap=softcap)
    for b, n in enumerate(case[4]):
        truth = dense_attention(query[b:b + 1], _keys_of(key_cache, kv.block_tables[b], n),
                                _keys_of(value_cache, kv.block_tables[b], n), [n - 1], head_size ** -0.5, window,
                                softcap)
        assert rel_err(ref[b:b + 1], truth) < 1e-6


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_reference_is_windowed_attention(case: tuple, softcap: float) -> None:
    query, kv, qsl = _prefill_inputs(case, torch.float32, "cpu", seed=2)
    head_size, window = case[2], case[6]
    key_cache, value_cache = kv.clean()
    ref = paged_prefill_attention_ref(query, key_cache, value_cache, kv.block_tables, qsl, kv.seq_lens,
                                      head_size ** -0.5, window=window, softcap=softcap)
    for b, (n, q_len) in enumerate(zip(case[4], case[5])):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        truth = dense_attention(query[rows], _keys_of(key_cache, kv.block_tables[b], n),
                                _keys_of(value_cache, kv.block_tables[b], n), list(range(n - q_len, n)),
                                head_size ** -0.5, window, softcap)
        assert rel_err(ref[rows], truth) < 1e-6


def test_softcap_changes_the_output() -> None:
    """The capped cases above test something: capping moves these outputs by far more than their tolerance."""
    kv, query = _decode_inputs(DECODE_CASES[0], torch.float32, "cpu", seed=1)
    args = (query, *kv.clean(), kv.block_tables, kv.seq_lens, 1.0)
    assert rel_err(paged_decode_attention_ref(*args, softcap=SOFTCAP), paged_decode_attention_ref(*args)) > 1e-2


def _prefill_inputs(case: tuple, dtype: torch.dtype, device: str, seed: int):  # noqa: ANN202
    heads, kv_heads, head_size, block_size, seq_lens, query_lens, _ = case
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, kv_heads, head_size, block_size, dtype, device, gen)
    query = randn(sum(query_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    return query, kv, query_start_loc(query_lens, device)


def _decode_first_read(case: tuple) -> list[int]:
    return [max(0, n - case[5]) for n in case[4]]


def _prefill_first_read(case: tuple, tile: int) -> list[int]:
    return [max(0, n - q - case[6] + 1) // tile * tile for n, q in zip(case[4], case[5])]


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_cpu_decode_window_and_softcap(case: tuple, dtype: torch.dtype, softcap: float) -> None:
    kv, query = _decode_inputs(case, dtype, "cpu", seed=3)
    scale = case[2] ** -0.5
    ref = paged_decode_attention_ref(query.float(), *(c.float() for c in kv.clean()), kv.block_tables,
                                     kv.seq_lens, scale, window=case[5], softcap=softcap)
    for b, first in enumerate(_decode_first_read(case)):
        _poison_before(kv, b, first)
    out = paged_decode_attention_cpu(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale,
                                     window=case[5], softcap=softcap)
    assert rel_err(out, ref) < ATTN_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_softcap_without_window(dtype: torch.dtype) -> None:
    """Capped scores over whole contexts (Gemma 2's global layers), sequences sharing leading blocks
    among them (the kernel attends such groups together only without a cap)."""
    case = DECODE_CASES[0]
    kv, query = _decode_inputs(case, dtype, "cpu", seed=9)
    kv.block_tables[1, :1] = kv.block_tables[2, :1]  # a shared first block
    scale = case[2] ** -0.5
    ref = paged_decode_attention_ref(query.float(), *(c.float() for c in kv.clean()), kv.block_tables,
                                     kv.seq_lens, scale, softcap=SOFTCAP)
    out = paged_decode_attention_cpu(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale,
                                     softcap=SOFTCAP)
    assert rel_err(out, ref) < ATTN_TOL[dtype]


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("window", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_prefill_window_and_softcap(case: tuple, dtype: torch.dtype, window: bool, softcap: float) -> None:
    query, kv, qsl = _prefill_inputs(case, dtype, "cpu", seed=4)
    scale, keys = case[2] ** -0.5, case[6] if window else 0
    ref = paged_prefill_attention_ref(query.float(), *(c.float() for c in kv.clean()), kv.block_tables, qsl,
                                      kv.seq_lens, scale, window=keys, softcap=softcap)
    if window:
        for b, first in enumerate(_prefill_first_read(case, CPU_TILE)):
            _poison_before(kv, b, first)
    for products in prefill_products(dtype):
        out = paged_prefill_attention_cpu(query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens,
                                          scale, products=products, window=keys, softcap=softcap)
        assert rel_err(out, ref) < ATTN_TOL[dtype], products


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize(("case", "num_splits"), [(DECODE_CASES[0], 1), (DECODE_CASES[3], 3), (DECODE_CASES[1], 2)])
def test_triton_decode_window_and_softcap(case: tuple, num_splits: int, softcap: float, device: str) -> None:
    dtype = torch.float32
    kv, query = _decode_inputs(case, dtype, device, seed=5)
    scale = case[2] ** -0.5
    ref = paged_decode_attention_ref(query, *kv.clean(), kv.block_tables, kv.seq_lens, scale, window=case[5],
                                     softcap=softcap)
    for b, first in enumerate(_decode_first_read(case)):
        _poison_before(kv, b, first)
    out = torch.full_like(query, math.nan)
    paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale,
                           max_seq_len=max(case[4]), out=out, num_splits=num_splits, window=case[5], softcap=softcap)
    assert rel_err(out, ref) < ATTN_TOL[dtype]


@pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_triton_prefill_window_and_softcap(case: tuple, softcap: float, device: str) -> None:
    dtype = torch.float32
    query, kv, qsl = _prefill_inputs(case, dtype, device, seed=6)
    scale = case[2] ** -0.5
    ref = paged_prefill_attention_ref(query, *kv.clean(), kv.block_tables, qsl, kv.seq_lens, scale,
                                      window=case[6], softcap=softcap)
    for b, first in enumerate(_prefill_first_read(case, 1)):
        _poison_before(kv, b, first)
    out = torch.full_like(query, math.nan)
    paged_prefill_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, scale,
                            max_query_len=max(case[5]), out=out, window=case[6], softcap=softcap)
    assert rel_err(out, ref) < ATTN_TOL[dtype]
