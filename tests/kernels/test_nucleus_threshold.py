"""Top-p's whole-row cut: the compiled CPU kernel against its sort-based reference
(kernels/nucleus.py), exactly, on fresh random weights of several shapes and shapes of
distribution (flat, peaked, with ties, with zeros), and the reference against its definition."""

from __future__ import annotations

import pytest
import torch
from streamer_kernels.elementwise_cpu import nucleus_threshold_cpu
from streamer_kernels.nucleus import nucleus_threshold_ref


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
