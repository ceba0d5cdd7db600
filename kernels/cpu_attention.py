"""Paged decode attention compiled for the CPU (C++, built on first use with the local compiler).

Defined by `paged_decode_attention_ref` in kernels/paged_attention.py: same inputs, same output.
If no compiler is available the caller falls back to the reference.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("streamer.kernels")
_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"


def _cpu_signature() -> str:
    """Built with -march=native, so a build cache must never be shared across CPU models; and per
    source path, since the build files name it (two checkouts sharing one would rebuild in turn)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    key = flags + _SOURCE.read_text() + str(_SOURCE.resolve()) + torch.__version__
    return hashlib.sha1(key.encode()).hexdigest()[:12]


@cache
def load() -> Any | None:
    """The compiled module, or None (no compiler)."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name=f"streamer_paged_decode_cpu_{_cpu_signature()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler / headers: the reference still works
        log.warning("CPU attention kernel unavailable (%s); using the torch reference", exc)
        return None


def paged_decode_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    module = load()
    if module is None:
        raise RuntimeError("CPU attention kernel is not available")
    return module.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
