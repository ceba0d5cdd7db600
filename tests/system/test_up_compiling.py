"""`streamer up` says when the worker compiles the CPU kernels (issue 42 item 1): for minutes on a
small machine its first start used to read "loading the model". The compiler is seen among the
worker's descendant processes (real processes here: a shell running a program named as a compiler)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from workers.cli.compiling import children, compiling
from workers.cli.up import KERNELS, wait_until


def _tree(tmp_path: Path, program: str) -> subprocess.Popen:
    """A shell (its own process group) whose child is `sleep` under the name `program`, which is what
    /proc's comm shows."""
    named = tmp_path / program
    shutil.copy(shutil.which("sleep") or "/bin/sleep", named)
    shell = subprocess.Popen(["sh", "-c", f"'{named}' 30; true"], start_new_session=True)
    deadline = time.monotonic() + 5
    while shell.pid not in children() and time.monotonic() < deadline:
        time.sleep(0.02)
    return shell


def test_a_compiler_among_the_descendants_is_seen(tmp_path: Path) -> None:
    for program, expected in (("cc1plus", True), ("ninja", True), ("napping", False)):
        shell = _tree(tmp_path, program)
        try:
            assert compiling(shell.pid) is expected, program
        finally:
            os.killpg(shell.pid, signal.SIGKILL)  # the shell and its child
            shell.wait()
    assert not compiling(2**22 + 1)  # no such process: nothing compiles


def test_the_wait_says_what_the_worker_does(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMER_PROGRESS", "0")  # plain lines, as when piped
    ready_at = time.monotonic() + 2.5
    wait_until(lambda: time.monotonic() > ready_at, [], 30, "loading the model", tick_s=1.0,
               doing=lambda: KERNELS)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith(f"      ... still {KERNELS} (") for line in lines), lines
