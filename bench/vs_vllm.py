"""streamer against vLLM's CPU build, side by side in one run, on the speed-anchor workloads.

    python -m bench.vs_vllm --model DIR [--workloads main,chat,prefill] [--dtype float32]
        [--repeats 3] [--vllm-python VENV/bin/python --anchors ANCHORS_DIR] [--json FILE]

`main` and `chat` are the anchor workloads (reproduced in bench/harness/workload.py; the fingerprints
printed by both sides must match), `prefill` is ours (long prompts, 8 output tokens), `sampled` is
`main` sampled with temperature 0.8, top-p 0.95, top-k 50 (no per-request seed: vLLM's CPU build
refuses them; vLLM runs the anchors' script with only its SamplingParams line changed). Both
engines get the same token ids, greedy unless sampled, ignore_eos, all requests at once, prefix caches reset
before each timed repeat, a few short unrelated requests first to warm up. Before every timed
run the benchmark waits for the machine to be quiet. streamer's repeats run half before and half
after vLLM's (the machine's speed drifts by 10-25% within minutes). Prints one table: output tokens/s of each
(median of the repeats), the ratio, and for streamer time to first token and peak KV use.
Without `--vllm-python` only streamer runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.machine import wait_quiet
from bench.harness.vllm import SAMPLED, VLLM_FLAGS, VLLM_SAMPLED
from bench.harness.workload import ANCHOR_WORKLOADS, fingerprint
from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from workers.allocator import CHOICES, exec_with_allocator
from workers.progress_display import Task, task

WORKLOADS = {**ANCHOR_WORKLOADS, "sampled": ANCHOR_WORKLOADS["main"]}
def warm_requests() -> list[dict]:
    rng = random.Random(12345)
    return [{"prompt": [rng.randrange(4, 32000) for _ in range(rng.randint(16, 200))], "max_tokens": 16}
            for _ in range(8)]


def generate(engine: LLMEngine, reqs: list[dict], label: str = "warm-up", sampling: dict | None = None) -> dict:
    """All requests at once; output tok/s, per-request time to first token, peak KV blocks."""
    with task(f"requests ({label})", total=len(reqs)) as bar:
        return _generate(engine, reqs, bar, sampling or {"temperature": 0.0})


def _generate(engine: LLMEngine, reqs: list[dict], bar: Task, sampling: dict) -> dict:
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(str(i), {"prompt_token_ids": r["prompt"]},
                           SamplingParams(**sampling, max_tokens=r["max_tokens"], ignore_eos=True))
    first: dict[str, float] = {}
    lengths: dict[str, int] = {}
    peak_blocks = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, now - start)
            lengths[out.request_id] = lengths.get(out.request_id, 0) + len(out.outputs[0].token_ids)  # deltas
            if out.finished:
                bar.advance()
        peak_blocks = max(peak_blocks, engine.scheduler.block_manager.num_used_blocks)
    wall = time.perf_counter() - start
    assert [lengths[str(i)] for i in range(len(reqs))] == [r["max_tokens"] for r in reqs], "output length mismatch"
    ttft = sorted(first.values())
    tokens = sum(r["max_tokens"] for r in reqs)
    total = tokens + sum(len(r["prompt"]) for r in reqs)
    return {"wall_s": wall, "output_tok_s": tokens / wall, "total_tok_s": total / wall,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "peak_kv_blocks": peak_blocks}


def streamer_engine(args: argparse.Namespace) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(args.model), dtype=args.dtype, block_size=args.block_size,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    generate(engine, warm_requests())
    return engine


def timed_runs(engine: LLMEngine, args: argparse.Namespace, name: str, reqs: list[dict], when: str) -> list[dict]:
    runs = []
    for i in range(args.repeats):
        engine.reset_prefix_cache()
        idle = wait_quiet(timeout=args.quiet_timeout_s)
        run = generate(engine, reqs, f"streamer {name}, {when}repeat {i + 1}/{args.repeats}",
                       SAMPLED if name == "sampled" else None)
        run["idle_before"] = idle
        runs.append(run)
        print(json.dumps({"system": "streamer", "workload": name, **{k: round(v, 3) for k, v in run.items()}}),
              file=sys.stderr, flush=True)
    return runs


def summarize(engine: LLMEngine, args: argparse.Namespace, runs: list[dict]) -> dict:
    stats = engine.stats()
    median = statistics.median(r["output_tok_s"] for r in runs)
    chosen = min(runs, key=lambda r: abs(r["output_tok_s"] - median))
    return {**chosen, "median_output_tok_s": median, "runs": runs,
            "kv_blocks_total": stats["kv_blocks_total"], "block_size": args.block_size,
            "prefix_cache_hit_tokens": stats.get("prefix_cache_hit_tokens"),
            "prefix_cache_query_tokens": stats.get("prefix_cache_query_tokens")}


def run_both(args: argparse.Namespace, name: str, reqs: list[dict]) -> tuple[dict, dict | None]:
    """streamer's repeats run both before and after vLLM's: this machine's speed drifts by 10-25%
    within minutes (shared hosts), and a drift while one side runs alone would bias the ratio."""
    engine = streamer_engine(args)
    runs = timed_runs(engine, args, name, reqs, "before vLLM, " if args.vllm_python else "")
    theirs = None
    if args.vllm_python:
        theirs = run_vllm(args, name, reqs)
        runs += timed_runs(engine, args, name, reqs, "after vLLM, ")
    ours = summarize(engine, args, runs)
    engine.shutdown()
    return ours, theirs


def run_vllm(args: argparse.Namespace, name: str, reqs: list[dict]) -> dict:
    script = Path(args.anchors) / "bench_vllm.py"
    program = [str(script)] if name != "sampled" else ["-c", VLLM_SAMPLED, str(script)]
    cmd = [args.vllm_python, *program, str(args.model), "--dtype", args.dtype, "--repeats", str(args.repeats),
           *VLLM_FLAGS[name]]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(reqs, f)
    if name in ("main", "chat"):
        cmd += ["--workload", name]
    elif name != "sampled":  # (sampled runs main's, named in its flags)
        cmd += ["--workload-file", f.name]
    wait_quiet(timeout=args.quiet_timeout_s)
    with task(f"vLLM {name}, {args.repeats} repeats"):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if name in ("main", "chat", "sampled") and result["fingerprint"] != fingerprint(reqs):
        raise RuntimeError(f"workload differs: vLLM ran {result['fingerprint']}, streamer {fingerprint(reqs)}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True,
                    help="a checkpoint directory: the anchors' Llama, or bench/moe_model.py's Qwen3-MoE")
    ap.add_argument("--workloads", default="main,chat,prefill,sampled")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    ap.add_argument("--anchors", help="the folder holding bench_vllm.py")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument("--quiet-timeout-s", type=float, default=600.0,
                    help="how long each timed run waits for an idle CPU before it runs anyway")
    ap.add_argument("--malloc", choices=CHOICES, default="tcmalloc",
                    help="streamer's allocator, as `streamer worker --malloc` (this process runs the engine)")
    args = ap.parse_args()
    exec_with_allocator(args.malloc)
    if args.vllm_python and not args.anchors:
        ap.error("--vllm-python needs --anchors")
    rows = []
    for name in args.workloads.split(","):
        reqs = WORKLOADS[name]()
        ours, theirs = run_both(args, name, reqs)
        rows.append({"workload": name, "fingerprint": fingerprint(reqs), "streamer": ours, "vllm": theirs})
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    runs = f"{2 * args.repeats} (half before, half after vLLM's {args.repeats})" if args.vllm_python else args.repeats
    print(f"\n{args.dtype}, torch threads {os.cpu_count()} cpus, streamer median of {runs}")
    print("| workload | fingerprint | streamer output tok/s (all tok/s) | vLLM | ratio | streamer TTFT mean / p99 (s) "
          "| streamer peak KV blocks |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        ours, theirs = row["streamer"], row["vllm"]
        vllm = "-"
        if theirs:
            total = (theirs["prompt_tokens"] + theirs["output_tokens"]) / theirs["median_wall_s"]
            vllm = f"{theirs['median_output_tok_s']:.1f} ({total:.0f})"
        ratio = f"**{ours['median_output_tok_s'] / theirs['median_output_tok_s']:.2f}x**" if theirs else "-"
        print(f"| {row['workload']} | {row['fingerprint']} | {ours['median_output_tok_s']:.1f} "
              f"({ours['total_tok_s']:.0f}) | {vllm} | {ratio} "
              f"| {ours['ttft_mean_s']:.2f} / {ours['ttft_p99_s']:.2f} "
              f"| {ours['peak_kv_blocks']} of {ours['kv_blocks_total']} ({ours['block_size']}-token) |")


if __name__ == "__main__":
    main()
