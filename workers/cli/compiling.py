"""Whether a process is compiling: the CPU kernels' first build runs the compiler in child processes
of the worker (torch's extension build: ninja, then the C++ compiler), minutes on a small machine.
`streamer up` looks for them to say so instead of "loading the model" for those minutes. Read from
/proc; where there is none (macOS) nothing is ever seen compiling, and up says what it said before.
"""

from __future__ import annotations

from pathlib import Path

# What a C++ extension build runs (the compiler driver, its passes, the linker, the build tool).
COMPILERS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "clang", "clang++", "as", "ld",
                       "collect2"})


def children(proc: Path = Path("/proc")) -> dict[int, list[int]]:
    """Every live process's children, by parent pid."""
    tree: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def compiling(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether a compiler or build tool runs among the descendants of `pid`."""
    tree = children(proc)
    todo = list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            if (proc / str(child) / "comm").read_text().strip() in COMPILERS:
                return True
        except OSError:
            continue
        todo.extend(tree.get(child, []))
    return False
