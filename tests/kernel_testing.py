"""Shared by the tests/kernels/test_kernels*.py files: devices, tolerances, and poisoned paged-cache inputs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Every kernel test runs on the CPU under the interpreter and, where there is one, on a GPU.
# A GPU run (STREAMER_TEST_CUDA=1) turns the interpreter off, and without it Triton cannot run
# CPU tensors; without a GPU the cuda cases have nothing to run on.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU Triton needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Relative-error bounds ||out - ref|| / ||ref||, per dtype.
# Attention: the kernels accumulate in float32 while the reference (torch SDPA in the storage
# dtype) rounds its intermediates, and on the GPU the 16-bit kernels round the softmax weights to
# the storage dtype for the P@V tensor-core product (2^-11 for fp16, 2^-8 for bf16 per weight).
# Measured under the interpreter: fp32 ~2e-7, fp16 ~2.5e-4, bf16 ~2e-3 (the reference's own
# rounding). The bounds leave ~5x for the GPU's extra rounding; a missing mask or a wrong block
# lookup gives errors of order 1.
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Elementwise kernels round every intermediate exactly where the reference's torch ops do, so
# 16-bit results match bit for bit under the interpreter (float32: ~5e-8, summation order). The
# bounds allow the GPU's exp/rsqrt to differ in the last float32 bit, which can flip a 16-bit
# rounding now and then (one ulp: 2^-11 fp16, 2^-8 bf16, on a few elements).
ELEMENTWISE_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}

# Cache slots a kernel must not use hold NaN: whatever reads one and lets it reach the output
# (even times a zero softmax weight) turns the output NaN. The reference gets a clean copy,
# because its dense gather reads every slot and only masks afterwards.
POISON = float("nan")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written or read poison"
    return ((out - ref).norm() / ref.norm()).item()


def randn(*shape: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32

    def clean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches with the poison replaced by zeros, for the reference."""
        return self.key_cache.nan_to_num(0.0), self.value_cache.nan_to_num(0.0)


def make_paged_kv(seq_lens: list[int], num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
                  device: str, gen: torch.Generator) -> PagedKV:
    """Random K/V for each sequence's first `seq_lens[b]` positions, in shuffled blocks.

    Everything a kernel must not read is POISON: slots past a sequence's end in its last block,
    the blocks nobody owns, and the padding of the block tables (which points at such a block).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold only poison
    width = max(blocks_per_seq) + 1  # always some table padding to misread
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, POISON, dtype=dtype, device=device)
    value_cache = torch.full(shape, POISON, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = order[-1]
    tables = []
    for b, n in enumerate(seq_lens):
        own, order = order[:blocks_per_seq[b]], order[blocks_per_seq[b]:]
        tables.append(own + [spare] * (width - len(own)))
        for i, blk in enumerate(own):
            rows = min(block_size, n - i * block_size)
            key_cache[blk, :rows] = randn(rows, num_kv_heads, head_size, dtype=dtype, device=device, gen=gen)
            value_cache[blk, :rows] = randn(rows, num_kv_heads, head_size, dtype=dtype, device=device, gen=gen)
    return PagedKV(key_cache, value_cache, torch.tensor(tables, dtype=torch.int32, device=device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device))


def query_start_loc(query_lens: list[int], device: str) -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)
