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


def test_segments_are_runs_of_one_slot() -> None:
    seg = Segments.from_slots(torch.tensor([-1, -1, 0, 0, 0, 2, 2, -1, 0, 1], dtype=torch.int32))
    assert seg.runs == [(0, 2, 5), (2, 5, 7), (0, 8, 9), (1, 9, 10)]  # base rows left out
    assert Segments.from_slots(torch.full((4,), -1, dtype=torch.int32)).empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False])  # rows laid out by adapter (as the engine does), or not
def test_segmented_equals_reference(dtype: torch.dtype, grouped: bool) -> None:
    x, a, b, slots, y = _case(37, 48, 80, 4, 8, dtype, "cpu")
    if grouped:
        slots = torch.sort(slots).values
    expected = y.float() + lora_delta_ref(x, slots, a, b)
    a_t, b_t = a.transpose(1, 2).float().contiguous(), b.transpose(1, 2).float().contiguous()  # the CPU layout
    out = lora_add_segmented(x, y.clone(), a_t, b_t, Segments.from_slots(slots))
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
