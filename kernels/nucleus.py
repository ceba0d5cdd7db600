"""Top-p's cut of a whole row without sorting it: the weight at which the nucleus ends."""

from __future__ import annotations

import torch


def nucleus_threshold_ref(weights: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """`weights` `[N, V]` (non-negative float32), `limit` `[N]` -> `[N]` float32: per row, the smallest
    weight w whose strictly heavier tokens weigh less than `limit` in all. The nucleus (top-p with
    limit = top_p x the row's total) is the tokens of weight >= w: a token is kept when the mass
    ranked before it falls short of the limit, ties kept or dropped together. Defined by a sort."""
    values, _ = weights.float().sort(dim=-1, descending=True)
    cumulative = values.double().cumsum(dim=-1)
    # Mass strictly above each value: a tie's run starts where the first of its equals does.
    start = torch.searchsorted(-values, -values, right=False)
    above = torch.where(start > 0, cumulative.gather(1, (start - 1).clamp(min=0)), torch.zeros_like(cumulative))
    kept = above < limit.double()[:, None]
    # Kept values form a prefix of the descending order: the threshold is the last kept one.
    last = kept.sum(dim=-1).clamp(min=1) - 1
    return values.gather(1, last[:, None])[:, 0]
