"""Triton paged attention (decode, split-K decode, prefill/extend) against the torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICES, DTYPES, make_paged_kv, query_start_loc, randn, rel_err
from streamer_kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from streamer_kernels.paged_decode_triton import MIN_SPLIT_SEQ_LEN, decode_num_splits, paged_decode_attention
from streamer_kernels.paged_prefill_triton import paged_prefill_attention

# (query heads, kv heads, head size, block size, context lengths): GQA ratios 1, 4, 8 and 3,
# head sizes 64/80/128, block sizes 8-64, lengths that are not multiples of the block size.
DECODE_CASES = [
    (4, 4, 64, 16, [1, 17, 40]),
    (8, 2, 80, 8, [33, 5, 64, 20]),
    (8, 1, 128, 32, [70, 3]),
    (6, 2, 64, 64, [100, 65]),
]


def _decode(case: tuple, dtype: torch.dtype, device: str, seed: int) -> tuple:
    heads, kv_heads, head_size, block_size, seq_lens = case
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, kv_heads, head_size, block_size, dtype, device, gen)
    query = randn(len(seq_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    ref = paged_decode_attention_ref(query, *kv.clean(), kv.block_tables, kv.seq_lens, head_size ** -0.5)
    return kv, query, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(case: tuple, dtype: torch.dtype, device: str) -> None:
    kv, query, ref = _decode(case, dtype, device, seed=len(case[4]) * 7 + case[2])
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, case[2] ** -0.5,
                           max_seq_len=max(case[4]), out=out, num_splits=1)
    assert rel_err(out, ref) < ATTN_TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "num_splits"), [(DECODE_CASES[1], 3), (DECODE_CASES[2], 2), (DECODE_CASES[3], 5)])
def test_split_k_decode_matches_reference(case: tuple, num_splits: int, dtype: torch.dtype, device: str) -> None:
    # Partitions are cut from the longest context, so shorter sequences leave later ones empty:
    # the merge must ignore those (their partial outputs are never written).
    kv, query, ref = _decode(case, dtype, device, seed=num_splits)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, case[2] ** -0.5,
                           out=out, num_splits=num_splits)
    assert rel_err(out, ref) < ATTN_TOL[dtype]


def test_split_count_follows_context_length_and_occupancy() -> None:
    sms = 132
    assert decode_num_splits(batch=1, num_kv_heads=8, max_seq_len=MIN_SPLIT_SEQ_LEN - 1, num_sms=sms) == 1
    assert decode_num_splits(batch=256, num_kv_heads=8, max_seq_len=32768, num_sms=sms) == 1  # GPU already full
    long_ctx = decode_num_splits(batch=1, num_kv_heads=8, max_seq_len=32768, num_sms=sms)
    assert 1 < long_ctx <= 64
    assert decode_num_splits(batch=1, num_kv_heads=8, max_seq_len=2048, num_sms=sms) <= 2048 // 256
    assert decode_num_splits(batch=4, num_kv_heads=8, max_seq_len=32768, num_sms=sms) < long_ctx


@pytest.mark.parametrize("device", DEVICES)
def test_decode_chooses_split_k_for_a_long_context(device: str) -> None:
    # Without num_splits the wrapper decides; one sequence of one KV head past the threshold splits
    # on any device (the interpreter counts as one multiprocessor).
    case = (4, 1, 64, 16, [MIN_SPLIT_SEQ_LEN + 77])
    kv, query, ref = _decode(case, torch.float32, device, seed=3)
    assert decode_num_splits(1, 1, MIN_SPLIT_SEQ_LEN + 77, num_sms=1) > 1
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 64 ** -0.5, out=out)
    assert rel_err(out, ref) < ATTN_TOL[torch.float32]


# (query heads, kv heads, head size, block size, context lengths, new-token counts): pure prefills
# (count == length), extends over cached context (count < length), single-token rows.
PREFILL_CASES = [
    (4, 4, 64, 16, [5, 40, 19], [5, 7, 19]),
    (8, 2, 80, 8, [33, 12], [33, 1]),
    (8, 1, 128, 32, [70, 9], [13, 9]),
    (6, 2, 64, 64, [90, 66], [21, 66]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_matches_reference(case: tuple, dtype: torch.dtype, device: str) -> None:
    heads, kv_heads, head_size, block_size, seq_lens, query_lens = case
    gen = torch.Generator().manual_seed(sum(query_lens))
    kv = make_paged_kv(seq_lens, kv_heads, head_size, block_size, dtype, device, gen)
    query = randn(sum(query_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    qsl = query_start_loc(query_lens, device)
    ref = paged_prefill_attention_ref(query, *kv.clean(), kv.block_tables, qsl, kv.seq_lens, head_size ** -0.5)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens,
                            head_size ** -0.5, max_query_len=max(query_lens), out=out)
    assert rel_err(out, ref) < ATTN_TOL[dtype]
