"""tcmalloc under the worker process (workers/allocator.py): the worker re-executes itself with it
preloaded, once, and not where the system allocator is asked for."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis_worker_helpers import worker_process

from clients.protocol import Names
from workers.allocator import find_tcmalloc

ROOT = Path(__file__).resolve().parents[2]
# Prints how often the program started and whether tcmalloc is mapped into it.
PROGRAM = """
import os, sys
from workers.allocator import exec_with_allocator
print("start", flush=True)
exec_with_allocator(sys.argv[1])
print("tcmalloc" in open("/proc/self/maps").read())
"""


def test_tcmalloc_is_installed_here():
    assert find_tcmalloc() is not None, ".ci/install installs libtcmalloc-minimal4"


def _run(choice: str, **env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, choice], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env}, check=True)
    return out.stdout.split()


def test_reexecutes_once_with_tcmalloc():
    assert _run("tcmalloc") == ["start", "start", "True"]


def test_system_allocator_stays():
    assert _run("system") == ["start", "False"]


def test_keeps_what_is_preloaded_already():
    lib = find_tcmalloc()
    assert _run("tcmalloc", LD_PRELOAD=lib) == ["start", "True"]


def _maps_of_worker(llama_ckpt: Path, redis_url: str, *extra: str) -> str:
    proc = worker_process(llama_ckpt, redis_url, *extra)
    try:
        r = redis.Redis.from_url(redis_url)
        wait_for_sync(lambda: len(r.keys(Names().worker("*"))) == 1, timeout=240)  # fresh clone: kernels compile
        return Path(f"/proc/{proc.pid}/maps").read_text()  # the same pid after the exec
    finally:
        proc.kill()
        proc.wait()


def wait_for_sync(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the worker did not register"
        time.sleep(0.1)


@pytest.mark.parametrize("choice, mapped", [("tcmalloc", True), ("system", False)])
def test_worker_process_runs_on_the_chosen_allocator(cpu_kernels, llama_ckpt, redis_url, choice, mapped):
    maps = _maps_of_worker(llama_ckpt, redis_url, "--malloc", choice)
    assert ("libtcmalloc" in maps) == mapped
