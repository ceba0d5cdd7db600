"""Served end to end: streamer (gateway + Redis + worker) against vLLM's OpenAI server, both driven
by vLLM's own benchmark client (`vllm bench serve`), in one run on this machine.

    python -m bench.serve_vs_vllm --model DIR --vllm-python VENV/bin/python
        [--dtype float32] [--rates inf,3] [--num-prompts 96] [--input-len 256] [--output-len 128]
        [--sampled] [--json FILE]

Each server is started, warmed with a few requests, measured at each `--rates` (requests/s; inf: all
at once) with `--dataset-name random`, `--ignore-eos`, the same seed and the same prompts, and
stopped; streamer goes first, then vLLM, then streamer again (the machine's speed drifts), and
streamer's figure is the median of its runs. vLLM runs as the anchors' README tunes it for 2 cores
(both cores bound, tcmalloc + Intel OpenMP preloaded). The client runs on the same cores as the
servers, as a user's would. `--sampled` sends temperature 0.8, top-p 0.95, top-k 50 instead of
greedy (vLLM's CPU build refuses per-request seeds, so none is sent). Prints per rate output tok/s,
TTFT p50/p99 and inter-token latency p50/p99 of each, and streamer/vLLM ratios (for latencies,
vLLM/streamer: above 1 is streamer ahead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from bench.harness.machine import ROOT
from bench.harness.servers import child_env, http_ok, stop_all, wait_for
from bench.harness.vllm import server_env
from clients.heartbeats import live_workers
from clients.protocol import Names
from workers.redis_server import RedisServer, free_port

# vLLM's client, called from Python: the CPU build's `vllm` console script fails (no distribution
# metadata). Prints the result's summary figures as one JSON line.
CLIENT = """
import argparse, json, sys
from vllm.benchmarks import serve
parser = argparse.ArgumentParser()
serve.add_cli_args(parser)
result = serve.main(parser.parse_args(sys.argv[1:]))
keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms")
print("RESULT " + json.dumps({k: result.get(k) for k in keys}))
"""
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of a process and all its descendants so far (Linux /proc)."""
    parent, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        pid = int(stat.parent.name)
        parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK
    total = 0.0
    for pid, seconds in cpu.items():
        p = pid
        while p and p != root:
            p = parent.get(p, 0)
        total += seconds if p == root else 0.0
    return total


def run_client(args: argparse.Namespace, base_url: str, model: str, rate: str, num_prompts: int) -> dict:
    cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", args.model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
           "--request-rate", rate, "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99"]
    if args.sampled:
        cmd += ["--temperature", "0.8", "--top-p", "0.95", "--top-k", "50"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"vLLM's client failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if result["failed"]:
        raise SystemExit(f"{result['failed']} of {num_prompts} requests failed against {base_url}")
    return result


def start_streamer(args: argparse.Namespace, redis_url: str, port: int) -> list[subprocess.Popen]:
    worker = [sys.executable, "-m", "workers.cli", "worker", "--model", args.model, "--redis", redis_url,
              "--dtype", args.dtype, "--max-num-seqs", "256", "--log-level", "WARNING"]
    procs = [subprocess.Popen(worker, cwd=ROOT, env=child_env())]
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: bool(live_workers(client, Names())), "streamer's worker", procs, timeout=900)
    gateway = [sys.executable, "-m", "workers.cli", "gateway", "--port", str(port), "--redis", redis_url,
               "--max-queued-jobs", "0", "--log-level", "WARNING"]
    procs.append(subprocess.Popen(gateway, cwd=ROOT, env=child_env()))
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), "streamer's gateway", procs)
    return procs


def start_vllm(args: argparse.Namespace, port: int, work: Path) -> list[subprocess.Popen]:
    env = server_env(args.vllm_python, work)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--tokenizer", args.model, "--port", str(port), "--dtype", args.dtype, "--max-model-len", "2048",
           "--seed", "0"]
    with open(work / "vllm.log", "w") as log:  # the child keeps its own descriptor
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)]
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/v1/models"), "vLLM's server", procs, timeout=900)
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    stop_all(list(reversed(procs)))  # the gateway before the worker it relays


def measure(args: argparse.Namespace, base_url: str, model: str, servers: dict[str, int]) -> dict[str, dict]:
    """Each rate's client result, with the CPU seconds each server process tree used per output
    token during it (`cpu_ms_per_token`: where the 2 cores went besides the client)."""
    run_client(args, base_url, model, "inf", 8)  # warm-up: kernels, caches, connections
    results = {}
    for rate in args.rates.split(","):
        before = {name: tree_cpu_seconds(pid) for name, pid in servers.items()}
        result = run_client(args, base_url, model, rate, args.num_prompts)
        tokens = args.num_prompts * args.output_len
        result["cpu_ms_per_token"] = {name: round(1e3 * (tree_cpu_seconds(pid) - before[name]) / tokens, 3)
                                      for name, pid in servers.items()}
        results[rate] = result
    return results


def streamer_run(args: argparse.Namespace) -> dict[str, dict]:
    port = free_port()
    with RedisServer() as server:
        procs = start_streamer(args, server.url, port)
        assert server.proc is not None
        servers = {"worker": procs[0].pid, "gateway": procs[1].pid, "redis": server.proc.pid}
        try:
            return measure(args, f"http://127.0.0.1:{port}", args.model, servers)
        finally:
            stop(procs)


def vllm_run(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    port = free_port()
    procs = start_vllm(args, port, work)
    try:
        return measure(args, f"http://127.0.0.1:{port}", args.model, {"server": procs[0].pid})
    finally:
        stop(procs)


def median_runs(runs: list[dict[str, dict]]) -> dict[str, dict]:
    return {rate: {m: statistics.median(r[rate][m] for r in runs) for m in METRICS} for rate in runs[0]}


def report(ours: dict[str, dict], theirs: dict[str, dict], runs: list[dict[str, dict]]) -> None:
    """Medians of streamer's runs against vLLM's, then the CPU each server's processes used (the
    last streamer run's)."""
    print(f"{'rate':>5} {'metric':<18} {'streamer':>10} {'vLLM':>10} {'ratio':>7}   streamer runs")
    for rate in ours:
        for m in METRICS:
            a, b = ours[rate][m], theirs[rate][m]
            ratio = a / b if m == "output_throughput" else b / a  # above 1: streamer ahead
            each = ", ".join(f"{r[rate][m]:.1f}" for r in runs)
            print(f"{rate:>5} {m:<18} {a:10.1f} {b:10.1f} {ratio:7.2f}x  {each}")
        ours_cpu = ", ".join(f"{k} {v}" for k, v in runs[-1][rate]["cpu_ms_per_token"].items())
        print(f"{rate:>5} CPU ms per output token: streamer {ours_cpu}; vLLM {theirs[rate]['cpu_ms_per_token']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory with its tokenizer")
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM's CPU build")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rates", default="inf,3")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--streamer-only", action="store_true", help="skip vLLM (e.g. to profile streamer)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [streamer_run(args)]
        theirs = None if args.streamer_only else vllm_run(args, Path(tmp))
        if theirs is not None:
            runs.append(streamer_run(args))
    ours = median_runs(runs)
    print(json.dumps({"streamer_runs": runs, "vllm": theirs}))
    if theirs is not None:
        report(ours, theirs, runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"streamer": ours, "streamer_runs": runs, "vllm": theirs}, indent=1))


if __name__ == "__main__":
    main()
