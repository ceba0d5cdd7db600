"""bench/gpu_check.sh stays runnable (issue 39): `--smoke` runs every step of the GPU check on the CPU and
prints its one table, and the folder bench/gpu_prepare.sh gathers holds, under the 64 MiB carry limit,
every package the check imports that the GPU image lacks."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.gpu_check import Step, kernel_summary, run_step

ROOT = Path(__file__).resolve().parents[2]

# The GPU image's Python packages, as issue 39 lists them; their own dependencies come with them.
GPU_IMAGE = ["torch", "triton", "transformers", "msgpack", "anyio", "httpx", "prometheus-client"]
CARRY_LIMIT = 64 << 20

# Put on PYTHONPATH, this records in every Python process of the check the top-level modules it imported.
RECORDER = '''import atexit, os, sys
def _record():
    with open(os.path.join(os.environ["IMPORT_RECORD_DIR"], f"{os.getpid()}.txt"), "w") as f:
        f.write("\\n".join(sorted({m.split(".")[0] for m in list(sys.modules)})))
atexit.register(_record)
'''


@dataclass
class SmokeRun:
    done: subprocess.CompletedProcess
    out: Path
    imported: set[str]  # distributions, canonical names
    processes: int


@pytest.fixture(scope="session")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    base = tmp_path_factory.mktemp("gpu_check")
    (base / "site").mkdir()
    (base / "site" / "sitecustomize.py").write_text(RECORDER)
    (base / "imports").mkdir()
    env = {**os.environ, "OUT": str(base / "out"), "IMPORT_RECORD_DIR": str(base / "imports"),
           "GPU_CARRY": str(base / "no-carry"), "PYTHONPATH": str(base / "site")}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    records = list((base / "imports").glob("*.txt"))
    modules = {m for f in records for m in f.read_text().split()}
    owners = md.packages_distributions()
    imported = {canonicalize_name(d) for m in modules - set(sys.stdlib_module_names) for d in owners.get(m, [])}
    return SmokeRun(done, base / "out", imported, len(records))


@pytest.fixture(scope="session")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("carry")
    done = subprocess.run(["bash", "bench/gpu_prepare.sh", str(dest)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"gpu_prepare.sh needs the package index and Debian's: {done.stderr[-2000:]}"
    return dest


def requirement_closure(names: list[str]) -> set[str]:
    """The distributions `names` need, themselves included, from the installed metadata (no extras)."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def test_smoke_check_runs_every_step_and_prints_one_table(smoke: SmokeRun) -> None:
    assert smoke.done.returncode == 0, smoke.done.stdout[-3000:] + smoke.done.stderr[-3000:]
    table = smoke.done.stdout.split("gpu_check --smoke:")[-1]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| step")]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        "kernel tests (interpreter)", "kernel bandwidth", "greedy parity vs transformers",
        "engine throughput vs transformers", "Redis worker, 64 jobs"]
    assert all(" | ok | " in r for r in rows), rows
    assert "skipped, needs CUDA:" in table and "CUDA graph capture/replay" in table
    # Everything is in OUT: the table, the results and one log per step.
    results = json.loads((smoke.out / "results.json").read_text())
    assert results["smoke"] and len(results["steps"]) == 5
    summary = (smoke.out / "summary.md").read_text()
    assert all(r in summary for r in rows) and "skipped, needs CUDA:" in summary
    assert len(list(smoke.out.glob("*.log"))) == 5
    parity = next(s for s in results["steps"] if s["step"].startswith("greedy parity"))
    assert {(r["arch"], r["dtype"]) for r in parity["result"]["runs"]} == {
        ("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"), ("qwen2", "bfloat16")}
    worker = next(s for s in results["steps"] if s["step"].startswith("Redis worker"))
    assert worker["result"]["redis"]["tokens"] == 64 * 8


def test_a_failing_or_stuck_step_is_failed_in_the_table(tmp_path: Path) -> None:
    failing = run_step(Step("exits badly", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 30),
                       tmp_path, 1, 30)
    assert failing["status"] == "FAILED" and "exit 3: boom" in failing["summary"]
    stuck = run_step(Step("sleeps long", [sys.executable, "-c", "import time; time.sleep(30)"], 30), tmp_path, 2, 1)
    assert stuck["status"] == "FAILED" and "timed out after 1 s" in stuck["summary"]
    mismatch = run_step(Step("says not ok", [sys.executable, "-c",
                                             "print('RESULT {\"ok\": false, \"summary\": \"tokens differ\"}')"], 30),
                        tmp_path, 3, 30)
    assert mismatch["status"] == "FAILED" and mismatch["summary"] == "tokens differ"
    assert kernel_summary("device-to-device copy: 9 GB/s; x\nrms_norm  T=4  triton  FAILED: boom\n")["ok"] is False


def test_carry_folder_is_under_the_limit_and_holds_what_the_check_imports(smoke: SmokeRun, carry: Path) -> None:
    assert smoke.processes >= 6, "the import recorder missed the check's processes"
    size = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    assert size < CARRY_LIMIT, f"{size} bytes"
    # What the check imported of streamer's (and the test runner's) declared requirements, less what the
    # image has: optional imports a library tries only where installed are not needed there.
    needed = (smoke.imported & requirement_closure(["streamer", "pytest", "pytest-timeout"])
              - requirement_closure(GPU_IMAGE) - {"streamer"})
    assert "redis" in needed and "pytest" in needed  # the recorder saw the worker and the kernel tests
    wheels = {canonicalize_name(w.name.split("-")[0]) for w in (carry / "wheels").glob("*.whl")}
    assert needed <= wheels, f"missing from the carry folder: {sorted(needed - wheels)}"
    assert "websockets" in wheels  # the gateway's, named by the issue
    # They install offline for the GPU machine's Python, as gpu_check.sh installs them.
    target = carry.parent / "site312"
    wheel_files = [str(w) for w in (carry / "wheels").glob("*.whl")]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--only-binary=:all:", "--python-version", "3.12", "--target", str(target), *wheel_files],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (target / "redis").is_dir() and (target / "websockets").is_dir()


def test_carried_redis_server_runs_unpacked(carry: Path, tmp_path: Path) -> None:
    for deb in (carry / "debs").glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True)
    libs = f"{tmp_path}/usr/lib/x86_64-linux-gnu:{tmp_path}/lib/x86_64-linux-gnu"
    done = subprocess.run([str(tmp_path / "usr/bin/redis-server"), "--version"], capture_output=True, text=True,
                          env={**os.environ, "LD_LIBRARY_PATH": libs}, timeout=30)
    assert done.returncode == 0 and "Redis server v=" in done.stdout, done.stderr
