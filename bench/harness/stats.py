"""Percentiles as every benchmark reports them."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The value at rank q (0..1) of the sorted values, NaN when there are none; NaNs are skipped
    (a latency that was never measured must not sort among the real ones)."""
    values = sorted(v for v in values if v == v)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
