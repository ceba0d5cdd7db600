"""The compiled CPU decode kernel against its reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_attention import load, paged_decode_attention_cpu
from kernels.paged_attention import paged_decode_attention_ref

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


def test_ignores_slots_past_each_length():
    """Poison every slot past a sequence's length: the output must not change."""
    gen = torch.Generator().manual_seed(7)
    key_cache = torch.randn(8, 16, 2, 64, generator=gen)
    value_cache = torch.randn(8, 16, 2, 64, generator=gen)
    tables = torch.tensor([[3, 5, 1]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    query = torch.randn(1, 4, 64, generator=gen)
    before = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    key_cache[5, 4:] = 1e4
    value_cache[5, 4:] = float("nan")
    key_cache[1] = 1e4
    after = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    assert torch.equal(before, after)
