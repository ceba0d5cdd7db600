"""bench/kernel_speed.py stays runnable: it skips cleanly without a GPU and runs every path with --smoke."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.kernel_speed", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_skips_cleanly_without_a_gpu() -> None:
    done = _run()
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and "skipped" in done.stdout


def test_bench_smoke_run_prints_a_table_with_every_kernel() -> None:
    done = _run("--smoke")
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("median of")[-1]
    for kernel in ("paged_decode", "paged_prefill", "rms_norm+residual", "silu_and_mul", "rotary",
                   "reshape_and_cache", "copy_blocks"):
        assert kernel in table
    assert "FAILED" not in done.stdout
    assert "sdpa (gathered)" in table and "torch ref" in table
