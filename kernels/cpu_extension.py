"""The CPU kernels of csrc/ (C++), built into one module on first use with the local compiler.

Each kernel is defined by its torch reference in this package (see csrc/cpu_ops.h). If no
compiler is available, `load()` returns None and callers use the references.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
from streamer_kernels.cpu_features import cpu_signature_text

log = logging.getLogger("streamer.kernels")
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "paged_decode_cpu.cpp", _CSRC / "decode_shared_prefix_cpu.cpp", _CSRC / "paged_prefill_cpu.cpp",
            _CSRC / "elementwise_cpu.cpp", _CSRC / "nucleus_cpu.cpp", _CSRC / "int8_gemm_cpu.cpp",
            _CSRC / "lora_cpu.cpp", _CSRC / "grouped_gemm_cpu.cpp", _CSRC / "bindings_cpu.cpp"]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cpu_signature() -> str:
    """Built with -march=native, so a build cache must never be shared across CPU models. Keyed by
    the sources' content and the flags, not their path: the build compiles copies of them kept in
    its own directory, so every checkout of the same sources shares one build."""
    key = cpu_signature_text() + torch.__version__ + " ".join(_CFLAGS)
    key += "".join(header.read_text() for header in sorted(_CSRC.glob("*.h")))
    for source in _SOURCES:
        key += source.name + source.read_text()
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def build_directory() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(f"streamer_cpu_kernels_{_cpu_signature()}", False))


@contextmanager
def _one_builder(build_dir: Path) -> Iterator[None]:
    """Our own lock around torch's build. torch's is a file that exists while a build runs: a
    process killed mid-build (a worker stopped during its first start) leaves it behind, and every
    later load then waits forever. An flock dies with its holder, so once we hold it no live
    builder of ours is running and a leftover torch lock file is stale."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "streamer.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


@cache
def load() -> Any | None:
    """The compiled module, or None (no compiler)."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        name = f"streamer_cpu_kernels_{_cpu_signature()}"
        build_dir = build_directory()
        with _one_builder(build_dir):
            sources = _staged_sources(build_dir)
            fresh = not (build_dir / f"{name}.so").exists()
            if fresh:  # minutes on a small machine: say so, a worker's start would look stuck
                log.warning("compiling the CPU kernels once (a few minutes on 2 cores; later starts, from any "
                            "checkout of the same sources, reuse the build in %s)", build_dir)
            started = time.monotonic()
            built = load_extension(name=name, sources=[str(s) for s in sources],
                                   extra_include_paths=[str(sources[0].parent)], extra_cflags=_CFLAGS,
                                   extra_ldflags=["-fopenmp"], verbose=False)
            if fresh:
                log.warning("CPU kernels compiled in %.0f s", time.monotonic() - started)
            return built
    except Exception as exc:  # no compiler / headers: the references still work
        log.warning("CPU kernels unavailable (%s); using the torch references", exc)
        return None


def _staged_sources(build_dir: Path) -> list[Path]:
    """Copies of the sources and headers in the build directory, rewritten only when their content
    changed (an untouched copy keeps its time, so ninja does not rebuild)."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for source in [*_SOURCES, *sorted(_CSRC.glob("*.h"))]:
        copy = staged / source.name
        text = source.read_bytes()
        if not copy.exists() or copy.read_bytes() != text:
            copy.write_bytes(text)
    return [staged / s.name for s in _SOURCES]


def module() -> Any:
    built = load()
    if built is None:
        raise RuntimeError("the CPU kernels are not available (no C++ compiler?)")
    return built
