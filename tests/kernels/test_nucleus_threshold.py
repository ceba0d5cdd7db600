"""Top-p's whole-row cut: the compiled CPU kernel against its sort-based reference
(kernels/nucleus.py), exactly, on fresh random weights of several shapes and shapes of
distribution (flat, peaked, with ties, with zeros), and the reference against its definition.
The whole sampling row (temperature, min-p, top-p in one kernel) against its reference."""

from __future__ import annotations

import pytest
import torch
from streamer_kernels.elementwise_cpu import nucleus_threshold_cpu, nucleus_weights_cpu
from streamer_kernels.nucleus import nucleus_threshold_ref, nucleus_weights_ref


def weights(rows: int, vocab: int, scale: float, seed: int, ties: bool = False, zeros: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    w = (logits - logits.max(dim=-1, keepdim=True).values).exp()
    if ties:  # few distinct values: whole runs of equal weights meet the cut
        w = (w * 16).round() / 16
        w[:, 0] = 1.0
    if zeros:  # min-p removed some tokens
        w = w * (w >= 0.05)
    return w.contiguous()


def by_definition(w: torch.Tensor, limit: float) -> torch.Tensor:
    """Kept iff the tokens strictly heavier weigh less than the limit (one row, in double)."""
    w = w.double()
    return torch.stack([(w * (w > x)).sum() for x in w]) < limit


@pytest.mark.parametrize("rows, vocab", [(1, 7), (5, 300), (16, 4096), (3, 32000)])
@pytest.mark.parametrize("scale, ties, zeros", [(0.3, False, False), (2.0, False, False), (8.0, False, False),
                                                (2.0, True, False), (2.0, False, True)])
def test_kernel_equals_reference(rows, vocab, scale, ties, zeros):
    for seed in range(3):
        w = weights(rows, vocab, scale, seed, ties, zeros)
        top_p = torch.rand(rows, generator=torch.Generator().manual_seed(seed + 100)) * 0.98 + 0.01
        limit = top_p * w.sum(dim=-1)
        assert torch.equal(nucleus_threshold_cpu(w, limit), nucleus_threshold_ref(w, limit))


@pytest.mark.parametrize("ties", [False, True])
def test_reference_keeps_what_the_definition_keeps(ties):
    w = weights(6, 200, 2.0, seed=9, ties=ties)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.99, 1.0])
    limit = top_p * w.sum(dim=-1)
    threshold = nucleus_threshold_ref(w, limit)
    for row in range(len(w)):
        assert torch.equal(w[row] >= threshold[row], by_definition(w[row], float(limit[row])))
    assert (w[0] >= threshold[0]).sum() < (w[4] >= threshold[4]).sum()  # the cut moves with top_p


def test_kernel_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="contiguous float32"):
        nucleus_threshold_cpu(torch.rand(4, 10).t(), torch.ones(10))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        nucleus_threshold_cpu(torch.rand(4, 10, dtype=torch.float64), torch.ones(4))


def rules(rows: int, seed: int, min_p: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=g) * 1.9 + 0.1
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    top_p[1::3] = 1.0  # min-p alone
    return temperature, top_p, (torch.rand(rows, generator=g) * 0.2 if min_p else torch.zeros(rows))


@pytest.mark.parametrize("rows, vocab", [(1, 7), (5, 300), (16, 4099), (3, 32000)])
@pytest.mark.parametrize("scale, min_p", [(0.3, False), (2.0, False), (8.0, False), (2.0, True)])
def test_whole_row_weights_equal_the_reference(rows, vocab, scale, min_p):
    """Weights within float32 rounding of the reference: the kernel multiplies by 1/temperature
    where the reference divides, so an exponent a can be one ulp of a apart, which moves e^a by a
    relative |a| x 2^-23 (4e-6 at a = -30; weights under e^-87 are 0 in both), and its exp is a
    polynomial of relative error ~1e-7. The kept tokens exactly the same, but for tokens under
    1e-12 of their row's mass: with top-p 1 the limit is the total, and whether a token that light
    is above the sums' rounding differs with their order; under e^-87 the kernel's exp gives 0
    where torch's gives a subnormal."""
    cut = 0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(rows, vocab, generator=g) * scale).contiguous()
        temperature, top_p, min_p_ = rules(rows, seed + 50, min_p)
        got = nucleus_weights_cpu(logits, temperature, top_p, min_p_)
        want = nucleus_weights_ref(logits, temperature, top_p, min_p_)
        uncut = ((logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]).double().exp()
        weighty = uncut > 1e-12 * uncut.sum(dim=-1, keepdim=True)
        assert torch.equal((got > 0)[weighty], (want > 0)[weighty])
        torch.testing.assert_close(got[weighty], want[weighty], rtol=1.2e-5, atol=0)
        cut += int((got == 0).sum())
    assert cut > 0  # the rules removed tokens: the test reaches them
