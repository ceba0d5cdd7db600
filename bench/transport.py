"""Transport overhead: the same workload through Redis (a `streamer worker` process + the Python
client) and through an in-process AsyncEngine, side by side.

    python -m bench.transport [--model tiny|bench|PATH] [--requests 32] [--prompt-len 64] [--max-tokens 64]
                              [--encoding msgpack|json] [--repeat 3]

Per request it records the time to first token (from submit to the first token in the caller's
hands) and the gaps between later token arrivals (per-token latency); prints p50/p99 of both and
the output throughput (tokens/s over the whole run) for each path. Redis runs on a private
redis-server on a free port; all requests are submitted at once, greedy, fixed length.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.machine import ROOT
from bench.harness.servers import child_env
from bench.harness.stats import percentile
from bench.harness.workload import bench_checkpoint, make_workload


@dataclass
class Trace:
    submitted: float
    arrivals: list[float] = field(default_factory=list)  # one per token, in arrival order

    def token(self, n: int) -> None:
        now = time.perf_counter()
        self.arrivals.extend([now] * n)


def summarize(name: str, traces: list[Trace], wall: float) -> dict:
    ttft = [t.arrivals[0] - t.submitted for t in traces]
    gaps = [b - a for t in traces for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
    tokens = sum(len(t.arrivals) for t in traces)
    return {"path": name, "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "tpot_p50_ms": 1e3 * statistics.median(gaps), "tpot_p99_ms": 1e3 * percentile(gaps, 0.99),
            "tokens_per_s": tokens / wall, "tokens": tokens}


def engine_options(args: argparse.Namespace) -> dict:
    return {"max_num_seqs": max(args.requests, 8), "num_kv_blocks": args.kv_blocks, "dtype": args.dtype}


async def run_in_process(engine, work: list[list[int]], args: argparse.Namespace, rep: int) -> dict:  # noqa: ANN001
    from streamer import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    traces = [Trace(0.0) for _ in work]
    start = time.perf_counter()

    async def one(i: int) -> None:
        traces[i].submitted = time.perf_counter()
        async for out in engine.generate({"prompt_token_ids": work[i]}, params, f"rep{rep}-{i}"):
            traces[i].token(len(out.outputs[0].token_ids))

    await asyncio.gather(*(one(i) for i in range(len(work))))
    return summarize("in-process AsyncEngine", traces, time.perf_counter() - start)


async def run_redis(client, work: list[list[int]], args: argparse.Namespace) -> dict:  # noqa: ANN001
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    traces = [Trace(0.0) for _ in work]
    start = time.perf_counter()

    async def one(i: int) -> None:
        traces[i].submitted = time.perf_counter()
        rid = await client.submit(prompt_token_ids=work[i], params=params)
        async for event in client.stream(rid, timeout=300):
            if event["type"] == "error":
                raise RuntimeError(f"request failed: {event}")
            if event["token_ids"]:
                traces[i].token(len(event["token_ids"]))

    await asyncio.gather(*(one(i) for i in range(len(work))))
    return summarize(f"Redis worker ({args.encoding})", traces, time.perf_counter() - start)


def start_worker(ckpt: Path, url: str, args: argparse.Namespace) -> subprocess.Popen:
    opts = engine_options(args)
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", str(ckpt), "--redis", url,
           "--max-num-seqs", str(opts["max_num_seqs"]), "--log-level", "WARNING"]
    cmd += ["--num-kv-blocks", str(args.kv_blocks)] if args.kv_blocks else []
    cmd += ["--dtype", args.dtype] if args.dtype else []
    # (whatever PYTHONPATH already holds stays after ROOT: bench/gpu_check.sh puts the kernels' import
    # name and the carried packages there)
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(keep_streamer_vars=True))


async def run_both(ckpt: Path, work: list[list[int]], args: argparse.Namespace, url: str) -> list[dict]:
    """Alternate the two paths `--repeat` times (so background load hits both alike); per path,
    the run with the median throughput."""
    import redis.asyncio as aioredis

    from clients.heartbeats import live_args, live_script
    from clients.protocol import Names
    from clients.redis_client import AsyncClient
    from streamer import AsyncEngine, EngineConfig, SamplingParams
    from workers.progress_display import task

    worker = start_worker(ckpt, url, args)
    runs: dict[str, list[dict]] = {"local": [], "redis": []}
    warm = {"prompt_token_ids": work[0][:8]}
    try:
        async with AsyncEngine(EngineConfig(model=str(ckpt), **engine_options(args))) as engine, \
                AsyncClient(url, encoding=args.encoding) as client:
            async for _ in engine.generate(warm, SamplingParams(max_tokens=4), "warm-up"):
                pass
            probe = aioredis.Redis.from_url(url)
            live = live_script(probe)
            while not await live(**live_args(Names())):  # the worker's first heartbeat
                if worker.poll() is not None:
                    raise RuntimeError("the worker exited during start-up")
                await asyncio.sleep(0.1)
            await probe.aclose()
            await client.generate(**warm, params={"max_tokens": 4}, timeout=120)
            with task("runs", total=2 * args.repeat) as bar:
                for rep in range(args.repeat):
                    bar.update(description=f"runs (repeat {rep + 1}/{args.repeat}: in-process)")
                    runs["local"].append(await run_in_process(engine, work, args, rep))
                    bar.advance()
                    bar.update(description=f"runs (repeat {rep + 1}/{args.repeat}: Redis)")
                    runs["redis"].append(await run_redis(client, work, args))
                    bar.advance()
                bar.update(description="runs")
    finally:
        worker.terminate()
        worker.wait(60)
    return [sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for r in runs.values()]


def table(rows: list[dict]) -> str:
    lines = ["| Path | TTFT p50 (ms) | TTFT p99 (ms) | per-token p50 (ms) | per-token p99 (ms) | tokens/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.2f} | "
                     f"{r['tpot_p99_ms']:.2f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def resolve_model(name: str, cache: Path) -> Path:
    if name == "bench":
        return bench_checkpoint(cache)
    if name == "tiny":
        from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

        path = cache / "llama-tiny-random"
        if not (path / "config.json").exists():
            build_checkpoint(path, TinyModelSpec(arch="llama"), seed=1)
        return path
    return Path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, bench (110M random Llama) or a checkpoint dir")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=None, help="KV cache blocks (default: sized by the engine)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--encoding", choices=("json", "msgpack"), default="msgpack")
    parser.add_argument("--repeat", type=int, default=3, help="runs per path; the median one is shown")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "streamer-bench"))
    args = parser.parse_args()

    from transformers import AutoConfig

    from workers.redis_server import RedisServer

    ckpt = resolve_model(args.model, Path(args.cache))
    vocab = AutoConfig.from_pretrained(ckpt).vocab_size
    work = make_workload(args.requests, vocab, mean_prompt=args.prompt_len, min_out=args.max_tokens,
                         max_out=args.max_tokens).prompts
    with RedisServer() as server:
        rows = asyncio.run(run_both(ckpt, work, args, server.url))
    print(f"model {ckpt.name}, {args.requests} requests, ~{args.prompt_len} prompt tokens, "
          f"{args.max_tokens} output tokens each, {os.cpu_count()} CPUs, median of {args.repeat} runs\n")
    print(table(rows))


if __name__ == "__main__":
    main()
