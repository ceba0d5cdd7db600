"""tcmalloc under the process that runs the engine.

Every step allocates and frees tensors of several MB (a prefill chunk's activations: 2,048 rows x
the MLP width). glibc's malloc returns blocks that large to the kernel when they are freed, so
the next step takes fresh pages and the kernel zeroes every one of them first: on a 2-core CPU
that was 4-9% of a prefill-heavy run's time in page faults, and the workload ran ~10% faster with
tcmalloc, which keeps freed memory for reuse (bench/README.md). vLLM's CPU build asks its users to
preload tcmalloc; streamer does it itself: a program that serves the engine calls
`exec_with_allocator` first, which re-executes it with tcmalloc in `LD_PRELOAD` (the allocator
has to be in place before the first allocation, so it cannot be switched on later).
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys

log = logging.getLogger("streamer.allocator")
CHOICES = ("tcmalloc", "system")


def find_tcmalloc() -> str | None:
    """The installed tcmalloc's library name (Debian/Ubuntu: libtcmalloc-minimal4), or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preloaded() -> bool:
    return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


def exec_with_allocator(choice: str) -> None:
    """With `choice` "tcmalloc", re-executes this process (same interpreter, same arguments) with
    tcmalloc preloaded, unless it already is or none is installed; returns otherwise. Call it
    before anything has started: nothing of this process survives the exec."""
    if choice != "tcmalloc" or preloaded():
        return
    lib = find_tcmalloc()
    if lib is None:
        log.info("tcmalloc is not installed; using the system allocator (apt install libtcmalloc-minimal4)")
        return
    env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
