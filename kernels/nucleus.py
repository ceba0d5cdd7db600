"""Top-p's cut of a whole row without sorting it: the weight at which the nucleus ends, and a whole
sampling row's weights with it (temperature, min-p, top-p)."""

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


def nucleus_weights_ref(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor) -> torch.Tensor:
    """`logits` `[N, V]` float32 and per-row rules `[N]` -> `[N, V]` unnormalised sampling weights of
    whole rows in vocabulary order: `exp((x - max) / temperature)`, zero where min-p (relative to
    the row's top weight, 1) or top-p (`nucleus_threshold_ref` of top_p x the mass min-p left)
    removes the token."""
    top = logits.max(dim=-1, keepdim=True).values
    weights = ((logits - top) / temperature[:, None]).exp()
    weights = weights * (weights >= min_p[:, None])
    # The limit in double, as the cut's sums: with top_p 1 a float32 total can round below the mass
    # above the lightest tokens and drop them.
    limit = top_p.double() * weights.double().sum(dim=-1)
    return weights * (weights >= nucleus_threshold_ref(weights, limit)[:, None])
