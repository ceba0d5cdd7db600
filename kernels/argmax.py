"""Greedy decoding's choice: the index of each row's largest logit."""

from __future__ import annotations

import torch


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """`logits` `[N, V]` -> `[N]` int64: the first index of each row's maximum; a NaN counts as
    larger than any number (torch.argmax's rule)."""
    return logits.argmax(dim=-1)
