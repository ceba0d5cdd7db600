"""The CPU kernels of csrc/ (C++), built into one module on first use with the local compiler.

Each kernel is defined by its torch reference in this package (see csrc/cpu_ops.h). If no
compiler is available, `load()` returns None and callers use the references.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
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
            _CSRC / "elementwise_cpu.cpp", _CSRC / "bindings_cpu.cpp"]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cpu_signature() -> str:
    """Built with -march=native, so a build cache must never be shared across CPU models; and per
    source path, since the build files name it (two checkouts sharing one would rebuild in turn)."""
    key = cpu_signature_text() + torch.__version__ + " ".join(_CFLAGS)
    key += "".join(header.read_text() for header in sorted(_CSRC.glob("*.h")))
    for source in _SOURCES:
        key += source.read_text() + str(source.resolve())
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

        with _one_builder(build_directory()):
            return load_extension(
                name=f"streamer_cpu_kernels_{_cpu_signature()}",
                sources=[str(s) for s in _SOURCES],
                extra_include_paths=[str(_CSRC)],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler / headers: the references still work
        log.warning("CPU kernels unavailable (%s); using the torch references", exc)
        return None


def module() -> Any:
    built = load()
    if built is None:
        raise RuntimeError("the CPU kernels are not available (no C++ compiler?)")
    return built
