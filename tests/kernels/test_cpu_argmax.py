"""The compiled CPU argmax of greedy sampling against its reference (torch.argmax), exactly: on
fresh random logits at several shapes, and where the rules matter: ties (the first index wins),
NaN (larger than anything), infinities, -0 against +0, rows shorter than one vector, strided rows."""

from __future__ import annotations

import pytest
import torch
from streamer_kernels.argmax import argmax_ref
from streamer_kernels.cpu_extension import load
from streamer_kernels.elementwise_cpu import argmax_cpu

from streamer.sampler import argmax

DTYPES = [torch.float32, torch.bfloat16]


def test_kernel_builds_here():
    assert load() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (32, 32000), (5, 151937), (64, 50), (2, 17)])
def test_matches_reference_on_random_logits(rows, vocab, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    assert torch.equal(argmax_cpu(logits), argmax_ref(logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_of_tied_maxima_wins(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=gen).to(dtype)
    for row, places in enumerate([[5, 6], [999, 0], [17, 33, 500], [16, 15], [3, 19], [998, 999]]):
        logits[row, places] = 100.0
    got = argmax_cpu(logits)
    assert got.tolist() == [5, 0, 17, 15, 3, 998]
    assert torch.equal(got, argmax_ref(logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_infinities_and_signed_zeros_follow_torch(dtype):
    rows = torch.full((7, 40), -1.0)
    rows[0, 21] = float("nan")
    rows[0, 30] = float("inf")        # NaN beats +inf
    rows[1, 35] = float("inf")
    rows[1, 36] = float("inf")
    rows[2] = float("-inf")           # every entry -inf: index 0
    rows[3] = -5.0
    rows[3, 38] = -0.5                # all negative
    rows[4] = 0.0
    rows[4, :10] = -0.0               # -0 and +0 tie: index 0
    rows[5, 39] = float("nan")        # a NaN in the tail past the last full vector
    rows[6, 2] = -float("nan")        # a NaN with its sign bit set
    logits = rows.to(dtype)
    assert torch.equal(argmax_cpu(logits), argmax_ref(logits))


def test_rows_with_a_stride():
    """A column slice of wider logits: rows are contiguous but further apart."""
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(9, 3000, generator=gen)
    logits = wide[:, :2500]
    assert logits.stride(0) == 3000
    assert torch.equal(argmax_cpu(logits), argmax_ref(logits))


def test_rejects_what_it_cannot_take():
    with pytest.raises(RuntimeError):
        argmax_cpu(torch.randn(4, 10).t())  # columns contiguous, not rows
    with pytest.raises(RuntimeError):
        argmax_cpu(torch.randn(4, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sampler_s_argmax_agrees_for_every_dtype(dtype):
    """float16 has no kernel: the sampler's helper falls back to torch for it."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 4099, generator=gen).to(dtype)
    assert torch.equal(argmax(logits), argmax_ref(logits))
