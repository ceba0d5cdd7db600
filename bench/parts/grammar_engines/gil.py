"""Whether a library's fills release the GIL: background work timed alone and beside them
(bench/grammar_engines.py)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def fake_forward(n_ops: int) -> None:
    """Python-driven torch work: what the main thread does while it launches a forward pass."""
    x = _FWD_X
    for _ in range(n_ops):
        x = torch.tanh(x @ _FWD_W)


_FWD_X = torch.randn(16, 128)
_FWD_W = torch.randn(128, 128) / 12
_BUFFER = os.urandom(1 << 20)


def _python_loop(n: int) -> None:  # holds the GIL throughout
    total = 0
    for i in range(n):
        total += i * i


def _hashing(n: int) -> None:  # hashlib drops the GIL for large buffers
    import hashlib

    for _ in range(n):
        hashlib.sha256(_BUFFER).digest()


def _sized(fn: Callable[[int], None], seconds: float, probe: int) -> Callable[[], None]:
    """`fn` with its count chosen so that one call takes about `seconds`."""
    a = time.perf_counter()
    fn(probe)
    per = (time.perf_counter() - a) / probe
    n = max(1, round(seconds / per))
    return lambda: fn(n)


def overlap_ratio(background: Callable[[], None], repeats: int = 3) -> dict:
    """`background` in a worker thread while the main thread runs `fake_forward` for as long,
    against the two one after the other: ~0.5 when they overlap (the background work releases
    the GIL and a core is free), ~1.0 when it holds the GIL."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stand-in forward takes one core, the background work the other
    try:
        background()  # warm
        alone = statistics.median(_timed(background) for _ in range(repeats))
        foreground = _sized(fake_forward, alone, 200)
        serial = statistics.median(_timed(lambda: (background(), foreground())) for _ in range(repeats))

        def together() -> None:
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(background)
                foreground()
                fut.result()

        both = statistics.median(_timed(together) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return {"ratio": both / serial, "serial_ms": serial * 1e3, "threaded_ms": both * 1e3,
            "gil_wait_ms": gil_wait(background)}


def gil_wait(background: Callable[[], None]) -> float:
    """Median milliseconds the main thread waits for the GIL after a short sleep while
    `background` runs in a thread: ~0 when the background work releases it in its native calls,
    ~the switch interval (5 ms) when it holds it. Unlike the ratio, this does not need a free core."""
    done = threading.Event()

    def run() -> None:
        background()
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    waits = []
    while not done.is_set():
        a = time.perf_counter()
        time.sleep(0.0005)
        waits.append(time.perf_counter() - a - 0.0005)
    worker.join()
    return statistics.median(waits) * 1e3


def _timed(fn: Callable[[], Any]) -> float:
    a = time.perf_counter()
    fn()
    return time.perf_counter() - a


def gil_controls(seconds: float) -> dict:
    """The same test on work known to hold the GIL (a Python loop) and to release it (hashing)."""
    return {"holds (Python loop)": overlap_ratio(_sized(_python_loop, seconds, 100_000)),
            "releases (hashlib.sha256)": overlap_ratio(_sized(_hashing, seconds, 20))}
