"""The machine a benchmark runs on: where things are, what a process costs, whether it is quiet."""

from __future__ import annotations

import os
import time
from pathlib import Path

from workers.progress_display import task

ROOT = Path(__file__).resolve().parents[2]  # the repository (or image working directory) holding bench/
CACHE_DIR = Path.home() / ".cache" / "streamer" / "bench"  # checkpoints built once, kept between runs


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time a process has used so far (Linux /proc); NaN without a process."""
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int | None) -> int | None:
    """A process's resident memory (Linux /proc), None when it is gone or unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def wait_quiet(min_idle: float = 0.93, window: float = 5.0, timeout: float = 600.0) -> float:
    """Block until the CPUs were idle for `min_idle` of a `window`; returns the idle share seen.
    Comparisons on a shared machine mean something only when both sides ran on a quiet one."""
    with task("waiting for an idle CPU", summary=False):
        return _wait_quiet(min_idle, window, timeout)


def _wait_quiet(min_idle: float, window: float, timeout: float) -> float:
    def times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = list(map(int, f.readline().split()[1:]))
        return v[3] + v[4], sum(v)

    deadline = time.monotonic() + timeout
    while True:
        i0, t0 = times()
        time.sleep(window)
        i1, t1 = times()
        idle = (i1 - i0) / max(1, t1 - t0)
        if idle >= min_idle or time.monotonic() > deadline:
            return idle


def model_or_tiny(model: str | None, tmp: str) -> str:
    """The checkpoint a serving benchmark runs: the one given, else a tiny random Llama built in `tmp`."""
    if model is not None:
        return model
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    return str(build_checkpoint(Path(tmp) / "tiny", TinyModelSpec(arch="llama"), seed=1))
