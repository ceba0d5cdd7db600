"""The one-shot GPU check (issue 39): every step as a child process, its log and result under --out,
one summary table at the end. `bench/gpu_check.sh` prepares the environment and runs this.

    python -m bench.gpu_check --out DIR [--smoke]

--smoke runs the same steps on CPU with tiny shapes and the Triton interpreter; what needs CUDA is
skipped and the table says so. Each step's script prints one last line `RESULT {json}`: the
numbers the table shows (and that land in DIR/results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.harness.machine import ROOT

RESULT_PREFIX = "RESULT "
TOTAL_BUDGET_S = 450.0  # the whole check, under the 8 minutes it is given (start-up and carry install apart)


# What --smoke leaves out because it needs CUDA, printed under its table.
CUDA_ONLY = ("skipped, needs CUDA: the kernel tests' cuda cases (STREAMER_TEST_CUDA=1) and the attention test "
             "files; CUDA-event timings with L2 flushes (wall clock here, so the bandwidth numbers mean nothing); "
             "CUDA graph capture/replay (parity runs eager only); the ~1.1B bfloat16 model and the 110M worker model "
             "(tiny float32 models here)")


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: float
    env: dict[str, str] | None = None
    summarize: Callable[[str], dict] | None = None  # the result from the log, for scripts without a RESULT line


def steps(smoke: bool, cuda: bool) -> list[Step]:
    py = sys.executable
    mode = ["--smoke"] if smoke else []
    # GPU: every kernel test on the device. Smoke: two of the files under the interpreter (the attention
    # files take minutes there, and CI runs all of them anyway as its own kernel tests).
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout"]
    if cuda:
        files = ["attention", "elementwise", "backend", "e2e", "window"]
        # The graph test alone from its file: the file's other cases need the interpreter, off here.
        graphs = "tests/engine/test_decode_graphs.py::test_captured_graph_replays_the_eager_decode"
        kernel_tests = Step("kernel tests (CUDA)",
                            pytest + [f"tests/kernels/test_kernels_{f}.py" for f in files] + [graphs],
                            150, env={"STREAMER_TEST_CUDA": "1"})
    else:
        kernel_tests = Step("kernel tests (interpreter)",
                            pytest + ["tests/kernels/test_kernels_elementwise.py",
                                      "tests/kernels/test_kernels_backend.py"], 120)
    return [
        kernel_tests,
        Step("kernel bandwidth", [py, "-m", "bench.kernel_speed", *mode], 120, summarize=kernel_summary),
        Step("greedy parity vs transformers", [py, "-m", "bench.gpu_parity", *mode], 150),
        Step("engine throughput vs transformers", [py, "-m", "bench.gpu_throughput", *mode], 180),
        Step("Redis worker, 64 jobs", [py, "-m", "bench.gpu_worker", *mode], 120),
    ]


def run_step(step: Step, out: Path, index: int, timeout_s: float) -> dict:
    """Runs one step with its output in its own log; its row of the table."""
    log = out / f"{index}-{'-'.join(w for w in step.name.split() if w.isalnum())}.log"
    # No pytest plugins but the ones named: what the kernel tests load must not depend on what else
    # the machine has installed (the GPU image has many), and the carry folder holds exactly what runs.
    env = {**os.environ, **(step.env or {}), "PYTHONUNBUFFERED": "1", "STREAMER_PROGRESS": "0",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            done = subprocess.run(step.command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
            rc: int | None = done.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    result = step.summarize(text) if step.summarize and rc == 0 else _last_result(text)
    if rc is None:
        status, summary = "FAILED", f"timed out after {timeout_s:.0f} s (log {log.name})"
    elif rc != 0:
        status, summary = "FAILED", f"exit {rc}: {_last_line(text)} (log {log.name})"
    else:
        status = "ok" if result.get("ok", True) else "FAILED"
        summary = result.get("summary", _last_line(text))
    return {"step": step.name, "status": status, "seconds": round(seconds, 1), "summary": summary,
            "result": result, "log": log.name}


def kernel_summary(text: str) -> dict:
    """bench/kernel_speed.py's table: the copy bandwidth, paged decode's best share of it, failures."""
    head, _, rows = text.partition("device-to-device copy:")
    copy = rows.split(";")[0].strip()
    decode = [ln.split() for ln in rows.splitlines() if ln.startswith("paged_decode") and " triton " in ln]
    shares = [int(c[:-1]) for r in decode for c in r if c.endswith("%") and c[:-1].isdigit()]
    failed = rows.count("FAILED")
    best = f"paged decode up to {max(shares)}% of copy" if shares else "no paged decode row"
    return {"ok": bool(copy) and failed == 0, "summary": f"copy {copy}; {best}; {failed} failed",
            "copy": copy, "decode_share_pct": shares}


def _last_result(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return {}


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def table(rows: list[dict]) -> str:
    lines = ["| step | status | seconds | result |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.1f} | {r['summary']} |" for r in rows]
    return "\n".join(lines)


def device_line() -> str:
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
    import triton

    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, triton {triton.__version__}, interpreter"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Triton interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton, here and in every step
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("gpu_check: no CUDA device: run with --smoke on a CPU machine", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_line()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    deadline = time.monotonic() + TOTAL_BUDGET_S
    for i, step in enumerate(steps(args.smoke, cuda), 1):
        print(f"[{i}] {step.name} ...", flush=True)
        # Each step within its own limit and what is left of the whole check's: one slow step fails
        # alone, and the check still ends (with its table) inside the GPU machine's time.
        rows.append(run_step(step, args.out, i, max(1.0, min(step.timeout_s, deadline - time.monotonic()))))
        print(f"    {rows[-1]['status']} in {rows[-1]['seconds']:.1f} s: {rows[-1]['summary']}", flush=True)
    report = f"gpu_check{' --smoke' if args.smoke else ''}: {device}, {started}\n\n{table(rows)}"
    if args.smoke:
        report += "\n\n" + CUDA_ONLY
    (args.out / "results.json").write_text(json.dumps({"device": device, "started": started, "smoke": args.smoke,
                                                       "steps": rows}, indent=2))
    (args.out / "summary.md").write_text(report + "\n")
    print("\n" + report)
    return 0 if all(r["status"] != "FAILED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
