"""The CPU decode kernel over shared cached prefixes (csrc/decode_shared_prefix_cpu.cpp): the
decodes of sequences whose block tables start with the same physical blocks are attended together
over those blocks, then each goes on over its own. The output is still the reference's."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import POISON, rel_err
from streamer_kernels.cpu_attention import paged_decode_attention_cpu
from streamer_kernels.cpu_extension import module
from streamer_kernels.paged_attention import paged_decode_attention_ref

# float32: the same sums in another order (measured ~4e-7). bfloat16: against float32 attention
# of the same rounded inputs; the shared part rounds its softmax weights to bfloat16 where the
# CPU has AVX-512 BF16 (measured ~2e-3, one rounding of the output).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def shared_caches(groups: list[tuple[int, list[int]]], kv_heads: int, head_size: int, block_size: int,
                  dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """Per group (shared prefix length, members' own lengths after it): caches whose prefix
    blocks are the same physical blocks in every member's table, scattered in the cache. Every
    slot nobody may read (past a length, unowned blocks, table padding) holds NaN."""
    tables, lens, owned = [], [], []
    for prefix, own in groups:
        shared = [len(owned) + i for i in range(-(-prefix // block_size))]
        owned += shared
        for n in own:
            blocks = list(shared)
            total = prefix + n
            while len(blocks) * block_size < total:
                blocks.append(len(owned))
                owned.append(len(owned))
            tables.append(blocks)
            lens.append(total)
    num_blocks = len(owned) + 2
    order = torch.randperm(num_blocks, generator=gen)
    width = max(len(t) for t in tables) + 1
    table = torch.full((len(tables), width), int(order[-1]), dtype=torch.int32)  # padding -> a poison block
    for b, blocks in enumerate(tables):
        table[b, :len(blocks)] = order[blocks].int()
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.full(shape, POISON, dtype=dtype)
    value_cache = torch.full(shape, POISON, dtype=dtype)
    flat_k, flat_v = key_cache.view(-1, kv_heads, head_size), value_cache.view(-1, kv_heads, head_size)
    for b, n in enumerate(lens):
        slots = [int(table[b, p // block_size]) * block_size + p % block_size for p in range(n)]
        for s in slots:
            if torch.isnan(flat_k[s]).any():  # a shared slot is written once
                flat_k[s] = torch.randn(kv_heads, head_size, generator=gen).to(dtype)
                flat_v[s] = torch.randn(kv_heads, head_size, generator=gen).to(dtype)
    return key_cache, value_cache, table, torch.tensor(lens, dtype=torch.int32)


CASES = [  # (heads, kv_heads, head_size, block_size, groups)
    (12, 4, 64, 16, [(208, [5, 17, 30, 1, 64])]),            # a system prompt, GQA 3
    (12, 4, 64, 16, [(200, [9, 40]), (0, [33, 2]), (48, [7, 7, 16])]),  # two groups and loners
    (8, 8, 64, 32, [(96, [3] * 40)]),                        # MHA: 40 members, more than one task's rows
    (16, 2, 128, 8, [(64, [1, 11, 30])]),                    # GQA 8, head size 128, block size 8
    (6, 2, 80, 16, [(160, [20, 3])]),                        # head size 80
    (12, 4, 64, 16, [(64, [0, 0, 0])]),                      # nothing after the prefix
    (12, 4, 64, 16, [(40, [10, 50])]),                       # a prefix ending mid-block
    (4, 4, 64, 16, [(300, [1]), (300, [1])]),                # equal lengths, different blocks
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_decode_matches_reference(case, dtype):
    heads, kv_heads, head_size, block_size, groups = case
    gen = torch.Generator().manual_seed(sum(p + sum(own) for p, own in groups) + heads)
    key_cache, value_cache, tables, lens = shared_caches(groups, kv_heads, head_size, block_size, dtype, gen)
    query = torch.randn(len(lens), heads, head_size, generator=gen).to(dtype)
    scale = head_size ** -0.5
    ref = paged_decode_attention_ref(query.float(), key_cache.nan_to_num(0).float(),
                                     value_cache.nan_to_num(0).float(), tables, lens, scale)
    out = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_groups_are_the_sequences_sharing_leading_blocks():
    """Full blocks only, up to the first block where any member differs and within every
    member's length; sequences without a partner are left to the per-sequence path."""
    tables = torch.tensor([
        [7, 8, 9, 20],   # 0: shares 7, 8, 9 with 1; only 7, 8 with 2
        [7, 8, 9, 21],   # 1
        [7, 8, 30, 31],  # 2
        [5, 6, 0, 0],    # 3: alone
        [4, 1, 2, 0],    # 4: shares 4 with 5, whose length stops at one full block
        [4, 1, 0, 0],    # 5
        [3, 0, 0, 0],    # 6: shares block 3 with 7, which has not filled it
        [3, 0, 0, 0],    # 7
    ], dtype=torch.int32)
    lens = torch.tensor([60, 50, 64, 30, 40, 31, 16, 15], dtype=torch.int32)
    groups = sorted(module().decode_prefix_groups(tables, lens, 16))
    assert groups == [([0, 1, 2], 2), ([4, 5], 1)]


def test_a_shared_block_is_read_for_the_group_and_the_rest_per_sequence():
    """Changing a shared position's K/V changes every member's output; changing a member's own
    position changes only that member's."""
    key_cache, value_cache, tables, lens = shared_caches([(64, [10, 20, 30])], 4, 64, 16, torch.float32,
                                                         torch.Generator().manual_seed(3))
    query = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(4))
    before = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    shared_slot = int(tables[0, 1]) * 16 + 5
    own = 64 + 3  # a position of member 1's own (its blocks after the 4 shared ones)
    own_slot = int(tables[1, own // 16]) * 16 + own % 16
    key_cache.view(-1, 4, 64)[own_slot] += 2.0
    middle = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    changed = (middle - before).abs().amax(dim=(1, 2)) > 0
    assert changed.tolist() == [False, True, False]
    value_cache.view(-1, 4, 64)[shared_slot] += 2.0
    after = paged_decode_attention_cpu(query, key_cache, value_cache, tables, lens, 0.125)
    assert ((after - middle).abs().amax(dim=(1, 2)) > 0).all()
