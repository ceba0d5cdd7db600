"""What the CPU can do, from the kernel's flags (Linux), for choices made before any kernel runs."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`avx512_bf16`, `amx_bf16`, ...); empty where they cannot be read."""
    try:
        return flags_in(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def flags_in(cpuinfo: str) -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo text (the first CPU's), as a set."""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def fast_bfloat16(flags: frozenset[str] | None = None) -> bool:
    """bfloat16 matrix products in hardware (AVX-512 BF16 or AMX): there bfloat16 runs ~2.5x
    faster than float32; elsewhere it is emulated and slower."""
    return bool({"avx512_bf16", "amx_bf16"} & (cpu_flags() if flags is None else flags))


def cpu_signature_text() -> str:
    """Text that changes with the CPU model's features: `-march=native` builds must not be shared
    across it."""
    flags = cpu_flags()
    return " ".join(sorted(flags)) if flags else platform.processor()
