"""Starting, waiting for and stopping the `streamer worker`/`gateway` processes a benchmark drives."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.harness.machine import ROOT


def child_env(root: Path = ROOT, keep_streamer_vars: bool = False) -> dict[str, str]:
    """The environment of a server process: `root` (this checkout) on PYTHONPATH, and whatever
    PYTHONPATH the benchmark was given after it (e.g. a folder with hiredis, to compare parsers).
    STREAMER_* settings of the caller's shell are dropped unless kept: the benchmark sets what it
    measures."""
    env = dict(os.environ) if keep_streamer_vars else \
        {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return env


def wait_for(ready: Callable[[], bool], what: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Poll `ready` until it holds; a server that exits meanwhile ends the benchmark at once."""
    end = time.monotonic() + timeout
    while not ready():
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{what}: a server exited with status {p.returncode}")
        if time.monotonic() > end:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.2)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def stop_all(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM all (in the order given: a gateway before the worker it relays), then wait for each,
    SIGKILL after `timeout` s: they drain side by side."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
