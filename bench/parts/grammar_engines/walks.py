"""Timing a library's bitmask fills: one document token by token, and a batch of them
(bench/grammar_engines.py)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.parts.grammar_engines.libraries import Engine

# ---- measurements ---------------------------------------------------------------------------

def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool(int(bitmask[row, token >> 5]) & (1 << (token & 31)))


def timed_repeats(fn: Callable[[], Any], repeats: int, budget_s: float) -> tuple[float, list[float], Any]:
    """Median seconds of up to `repeats` calls (fewer once `budget_s` is spent, at least one)."""
    times, result = [], None
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), times, result


def walk_single(eng: Engine, compiled: Any, tokens: list[int], vocab: int, eos: int, check: bool) -> dict:
    """Batch 1: fill + accept each token of one document; per-token microseconds."""
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    m = eng.matcher(compiled)
    fills, accepts = [], []
    clock = time.perf_counter_ns
    for t in tokens:
        a = clock()
        eng.fill(m, bitmask, 0)
        b = clock()
        if check and not _allowed(bitmask, 0, t):
            raise AssertionError(f"{eng.name}: token {t} not allowed by its mask")
        c = clock()
        ok = eng.accept(m, t)
        d = clock()
        if not ok:
            raise AssertionError(f"{eng.name}: token {t} rejected")
        fills.append((b - a) / 1e3)
        accepts.append((d - c) / 1e3)
    a = clock()
    eng.fill(m, bitmask, 0)
    fills.append((clock() - a) / 1e3)
    if check and not _allowed(bitmask, 0, eos):
        raise AssertionError(f"{eng.name}: end of sequence not allowed after a complete document")
    return {"mask_mean_us": statistics.fmean(fills), "mask_p99_us": _p99(fills),
            "accept_mean_us": statistics.fmean(accepts), "tokens": len(tokens)}


def walk_batch(eng: Engine, compiled: Any, docs: list[list[int]], vocab: int, batched: bool = True,
               check: bool = False, keep_mask_at: int = -1) -> dict:
    """Batch B: each matcher walks its own document; one bitmask [B, vocab/32] filled per step."""
    B = len(docs)
    bitmask = torch.zeros((B, (vocab + 31) // 32), dtype=torch.int32)
    ms = [eng.matcher(compiled) for _ in range(B)]
    fill = eng.fill_batch if batched else Engine.fill_batch.__get__(eng)
    accept = eng.accept_batch if batched else Engine.accept_batch.__get__(eng)
    per_token, steps, fill_total, acc_total, n_tokens, kept = [], [], 0.0, 0.0, 0, None
    for pos in range(max(map(len, docs))):
        rows = [i for i in range(B) if pos < len(docs[i])]
        active = [ms[i] for i in rows]
        toks = [docs[i][pos] for i in rows]
        a = time.perf_counter()
        fill(active, bitmask, rows)
        b = time.perf_counter()
        if check:
            for r, t in zip(rows, toks):
                if not _allowed(bitmask, r, t):
                    raise AssertionError(f"{eng.name}: batched mask disallows token {t} of row {r}")
        if pos == keep_mask_at:
            kept = bitmask.clone()
        c = time.perf_counter()
        ok = accept(active, toks)
        d = time.perf_counter()
        if not all(ok):
            raise AssertionError(f"{eng.name}: a batched accept failed")
        steps.append(b - a)
        per_token.append((b - a) * 1e6 / len(rows))
        fill_total += b - a
        acc_total += d - c
        n_tokens += len(rows)
    return {"mask_mean_us": fill_total * 1e6 / n_tokens, "mask_p99_us": _p99(per_token),
            "step_mean_ms": statistics.fmean(steps) * 1e3, "step_p99_ms": _p99(steps) * 1e3,
            "accept_mean_us": acc_total * 1e6 / n_tokens, "tokens": n_tokens, "kept_mask": kept}
