"""The compiled multi-LoRA kernel (csrc/lora_cpu.cpp, through kernels/lora.py: lora_add_cpu) against
its definition, `lora_delta_ref`, on fresh random inputs: mixes of runs of several adapters and
base rows, grouped as the engine lays them out and not, stack ranks 8, 16 and 64 with adapters of
the full rank, of less (zero padding the kernel leaves out) and of none on some parts, one slot
holding an adapter of the fused module as a whole, and shapes with and without whole vectors.

Tolerance. float32: relative error of the delta 1e-5. Both sides sum in float32, in different
orders (register tiles, fused multiply-adds under -ffast-math): a few ulps (1.2e-7) times the
~sqrt(in) growth of a sum's rounding error. bfloat16 (x and y, with float32 stacks): the kernel
adds its float32 delta into y and rounds once, as the reference's `y.float() + delta` rounded;
every element within 2^-8 of its value (a half ulp, 2^-9, is the rounding; the other half covers
a float32 sum landing on the other side of a rounding boundary), plus 1e-5 absolute where y and the
delta cancel. Stacks in bfloat16 (a bfloat16 model's, widened as
the kernel reads them): the definition runs on the same rounded weights, so the same bounds hold."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import rel_err
from streamer_kernels.cpu_extension import load
from streamer_kernels.lora import Segments, lora_add_cpu, lora_delta_ref


def _stacks(gen: torch.Generator, slots: int, n_in: int, sizes: list[int], rank: int):
    """Stacks in the engine's CPU layout (streamer/lora/stacks.py) and the same weights in the
    definition's: a [S, K, in], b [S, out, K] with K = parts x rank, part p of a slot in rank
    columns p*rank : p*rank + r (r its adapter's rank, 0 for a part the adapter leaves out) and its
    own output columns. The last slot holds an adapter of the fused module as a whole (every part
    reads the same columns)."""
    parts, out = len(sizes), sum(sizes)
    cols = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    a = torch.zeros(slots, parts * rank, n_in)
    b = torch.zeros(slots, out, parts * rank)
    spans = torch.zeros(slots, parts, 2, dtype=torch.int64)
    for s in range(slots):
        if s == slots - 1 and parts > 1:
            r = rank - 1
            a[s, :r] = torch.randn(r, n_in, generator=gen) / n_in ** 0.5
            b[s, :, :r] = torch.randn(out, r, generator=gen) / r ** 0.5
            spans[s] = torch.tensor([0, r])
            continue
        for p in range(parts):
            r = [rank, rank // 2, 3, 0][(s + p) % 4]  # full, half, odd (no whole vector), none
            lo = p * rank
            a[s, lo:lo + r] = torch.randn(r, n_in, generator=gen) / n_in ** 0.5
            b[s, cols[p]:cols[p + 1], lo:lo + r] = torch.randn(sizes[p], r, generator=gen) / max(r, 1) ** 0.5
            spans[s, p] = torch.tensor([lo, lo + r])
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()
    return a, b, a_t, b_t, spans, torch.tensor(cols, dtype=torch.int64)


def _row_slots(gen: torch.Generator, rows: int, slots: int, grouped: bool) -> torch.Tensor:
    row_slots = torch.randint(-1, slots, (rows,), generator=gen, dtype=torch.int32)
    if grouped:  # the engine's layout: one run per adapter, the base rows among them
        order = torch.randperm(slots + 1, generator=gen) - 1
        row_slots = torch.cat([row_slots[row_slots == s] for s in order.tolist()])
    return row_slots


SHAPES = [  # rows, in, part sizes, stack rank
    (64, 576, [576, 192, 192], 16),  # SmolLM2-135M's q/k/v
    (64, 576, [1536, 1536], 16),  # its gate/up
    (48, 1536, [576], 8),  # its down
    (37, 200, [300], 64),  # no whole vectors past 192 in or 296 out
    (9, 96, [40, 13], 64),  # rows fewer than a tile, parts not of whole vectors
    (130, 64, [64, 64], 8),  # many tasks
]


def test_kernels_build_here():
    assert load() is not None, "the C++ CPU kernels must compile on this machine (g++ and ninja are installed)"
    assert hasattr(load(), "lora_add_runs")


@pytest.mark.parametrize("stack_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("rows,n_in,sizes,rank", SHAPES)
def test_lora_kernel_equals_definition(rows: int, n_in: int, sizes: list[int], rank: int, grouped: bool,
                                       dtype: torch.dtype, stack_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n_in + rank + grouped)
    slots = 4
    a, b, a_t, b_t, spans, part_cols = _stacks(gen, slots, n_in, sizes, rank)
    if stack_dtype == torch.bfloat16:  # (a bfloat16 model's stacks: the definition on the same weights)
        a, b, a_t, b_t = (w.to(stack_dtype) for w in (a, b, a_t, b_t))
        a, b = a.float(), b.float()
    row_slots = _row_slots(gen, rows, slots, grouped)
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    y = torch.randn(rows, sum(sizes), generator=gen).to(dtype)
    delta = lora_delta_ref(x, row_slots, a, b)
    assert delta.abs().mean() > 0.3 * y.float().abs().mean()  # the delta is not lost in y's values

    out = lora_add_cpu(x, y.clone(), a_t, b_t, Segments.from_slots(row_slots), spans, part_cols)

    assert out.dtype == dtype
    base = row_slots < 0
    assert torch.equal(out[base], y[base])  # base rows untouched, bit for bit
    if dtype == torch.float32:
        assert rel_err(out - y, delta) < 1e-5
    else:
        expected = y.float() + delta
        assert ((out.float() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-5).all()


def test_lora_kernel_strided_rows_and_no_runs() -> None:
    """x's rows may be a view with a stride (a slice of a wider tensor); a step without adapter
    rows leaves y as it is."""
    gen = torch.Generator().manual_seed(5)
    a, b, a_t, b_t, spans, part_cols = _stacks(gen, 2, 64, [48, 16], 16)
    wide = torch.randn(20, 100, generator=gen)
    x = wide[:, 10:74]
    row_slots = torch.tensor([0] * 8 + [-1] * 4 + [1] * 8, dtype=torch.int32)
    y = torch.randn(20, 64, generator=gen)
    out = lora_add_cpu(x, y.clone(), a_t, b_t, Segments.from_slots(row_slots), spans, part_cols)
    assert rel_err(out - y, lora_delta_ref(x, row_slots, a, b)) < 1e-5
    none = torch.full((20,), -1, dtype=torch.int32)
    assert torch.equal(lora_add_cpu(x, y.clone(), a_t, b_t, Segments.from_slots(none), spans, part_cols), y)


def test_lora_kernel_refuses_bad_runs() -> None:
    gen = torch.Generator().manual_seed(6)
    _, _, a_t, b_t, spans, part_cols = _stacks(gen, 2, 64, [32], 8)
    x, y = torch.randn(4, 64), torch.randn(4, 32)
    for runs in ([[2, 0, 4]], [[0, 2, 5]]):  # a slot past the stacks; rows past the batch
        with pytest.raises(RuntimeError, match="outside"):
            load().lora_add_runs(x, y, a_t, b_t, torch.tensor(runs), spans, part_cols)
    with pytest.raises(RuntimeError, match="one dtype"):
        load().lora_add_runs(x, y, a_t, b_t.bfloat16(), torch.tensor([[0, 0, 4]]), spans, part_cols)
