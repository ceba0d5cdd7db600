"""The multi-LoRA products against their definition (kernels/lora.py): the CPU segmented product the
engine runs, and the Triton kernel under the interpreter (on a GPU where there is one)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICES, rel_err
from streamer_kernels.lora import Segments, lora_add_segmented, lora_delta_ref

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(n: int, n_in: int, n_out: int, slots: int, rank: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=gen).to(device, dtype)
    a = torch.randn(slots, rank, n_in, generator=gen).to(device, dtype) / n_in ** 0.5
    b = torch.randn(slots, n_out, rank, generator=gen).to(device, dtype)
    # Base rows (-1) between and around rows of every slot, unsorted, one slot left unused.
    row_slots = torch.randint(-1, slots - 1, (n,), generator=gen).to(device, torch.int32)
    y = torch.randn(n, n_out, generator=gen).to(device, dtype)
    return x, a, b, row_slots, y


def test_segments_group_rows_by_slot() -> None:
    seg = Segments.from_slots(torch.tensor([2, -1, 0, 2, -1, 0, 1], dtype=torch.int32))
    # One block of 2 rows per slot, base rows left out, batch order within a slot; slot 1's block
    # is padded (row 0, zeroed by the pad mask).
    assert (seg.num_slots, seg.length, seg.count) == (3, 2, 5)
    assert seg.index.tolist() == [2, 5, 6, 0, 0, 3]
    assert seg.pad is not None and seg.pad.flatten().tolist() == [1, 1, 1, 0, 1, 1]
    even = Segments.from_slots(torch.tensor([1, 0, 0, 1], dtype=torch.int32))
    assert even.index.tolist() == [1, 2, 0, 3] and even.pad is None  # nothing padded: no mask
    assert Segments.from_slots(torch.full((4,), -1, dtype=torch.int32)).empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_equals_reference(dtype: torch.dtype) -> None:
    x, a, b, slots, y = _case(37, 48, 80, 4, 8, dtype, "cpu")
    expected = y.float() + lora_delta_ref(x, slots, a, b)
    seg = Segments.from_slots(slots, dtype=dtype)
    out = lora_add_segmented(x, y.clone(), a.transpose(1, 2), b.transpose(1, 2), seg)
    assert rel_err(out, expected) < TOL[dtype]
    base = slots < 0
    assert torch.equal(out[base], y[base])  # base rows untouched, bit for bit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_in,n_out", [(64, 96), (200, 33)])  # tiles whole and ragged
def test_triton_equals_reference(device: str, dtype: torch.dtype, n_in: int, n_out: int) -> None:
    from streamer_kernels.lora_triton import lora_add

    x, a, b, slots, y = _case(9, n_in, n_out, 3, 16, dtype, device, seed=n_in)
    expected = y.float() + lora_delta_ref(x, slots, a, b)
    out = lora_add(x, y.clone(), slots, a, b)
    assert rel_err(out, expected) < TOL[dtype]
    base = slots < 0
    assert torch.equal(out[base], y[base])
