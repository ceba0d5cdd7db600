"""Interactive time to first token with and without a concurrent OpenAI Batch API batch, in one run.

    python -m bench.batch_interactive [--rate 4] [--duration 20] [--batch-lines 2000] [--repeats 2] [--model DIR]

Everything is real and on this machine: a private redis-server, one `streamer worker` (a tiny random
Llama unless --model), one `streamer gateway`. The interactive load is an open loop: streaming chat
requests sent at --rate per second for --duration seconds (the same arrival times in every phase),
each read as plain SSE to its end; its time to first token is from the request being sent to the
first content chunk. Phases alternate `alone` and `with batch` (--repeats each, `alone` first): a
`with batch` phase uploads a --batch-lines batch through `/v1/files` and `/v1/batches` just before
the interactive load starts (its lines wait in the batch lane, below every interactive lane:
docs/scheduling.md), and cancels it once the load ends. Reported: TTFT p50/p99 of each kind of phase
(all their requests together), the ratio with/without, the batch lines answered while the
interactive load ran, and the engine's preemptions in each phase (from the worker's /metrics: batch
sequences preempted for interactive ones, recomputed later).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import tempfile
import time
import urllib.request

import redis

from bench.harness.machine import ROOT, model_or_tiny
from bench.harness.servers import child_env, http_ok, stop_all, wait_for
from bench.harness.stats import percentile
from clients.heartbeats import live_workers
from clients.protocol import Names
from workers.progress_display import task
from workers.redis_server import RedisServer, free_port

QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


async def interactive(base_url: str, model: str, rate: float, duration: float, max_tokens: int) -> list[float]:
    """TTFT (s) of each request of the open loop."""
    import httpx

    body = {"model": model, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    count = int(rate * duration)
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        async def one(at: float) -> float:
            await asyncio.sleep(at)
            sent = time.perf_counter()
            first = None
            async with http.stream("POST", "/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                            first = time.perf_counter()
            if first is None:
                raise RuntimeError("a stream ended without content")
            return first - sent

        return list(await asyncio.gather(*(one(i / rate) for i in range(count))))


async def phase(base_url: str, args: argparse.Namespace, model: str, with_batch: bool) -> tuple[list[float], int]:
    """One phase: (interactive TTFTs, batch lines answered meanwhile)."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=2, timeout=600) as client:
        batch = None
        if with_batch:
            lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": model, "messages": [{"role": "user", "content": f"Item {i}: summarize it."}],
                               "max_tokens": args.batch_tokens, "temperature": 0, "ignore_eos": True}}
                     for i in range(args.batch_lines)]
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            up = await client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            while (await client.batches.retrieve(batch.id)).request_counts.completed == 0:  # it runs
                await asyncio.sleep(0.1)
        ttfts = await interactive(base_url, model, args.rate, args.duration, args.max_tokens)
        answered = 0
        if batch is not None:
            now = await client.batches.retrieve(batch.id)
            answered = now.request_counts.completed
            if now.status == "completed":  # it did not cover the whole load: say so, do not hide it
                print(f"warning: the batch ended before the interactive load did ({answered} lines); "
                      "raise --batch-lines", file=sys.stderr)
            else:
                await client.batches.cancel(batch.id)
                while (await client.batches.retrieve(batch.id)).status not in ("cancelled", "completed"):
                    await asyncio.sleep(0.2)
        return ttfts, answered


def preemptions(metrics_port: int) -> int:
    """The worker engine's preemptions so far (`vllm:num_preemptions_total`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_preemptions_total")))


def start_servers(args: argparse.Namespace, redis_url: str, model: str, port: int, metrics_port: int
                  ) -> list[subprocess.Popen]:
    worker = [sys.executable, "-m", "workers.cli", "worker", "--model", model, "--redis", redis_url,
              "--device", args.device, "--max-num-seqs", str(args.max_num_seqs), "--log-level", "WARNING",
              "--metrics-port", str(metrics_port)]
    procs = [subprocess.Popen(worker, cwd=ROOT, env=child_env())]
    client = redis.Redis.from_url(redis_url)
    with task("starting the worker"):
        wait_for(lambda: bool(live_workers(client, Names())), "the worker", procs)
    gateway = [sys.executable, "-m", "workers.cli", "gateway", "--port", str(port), "--redis", redis_url,
               "--batch-seat-share", str(args.batch_seat_share), "--log-level", "WARNING"]
    procs.append(subprocess.Popen(gateway, cwd=ROOT, env=child_env()))
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), "the gateway", procs)
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0, help="interactive requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of interactive load per phase")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens of each interactive answer")
    ap.add_argument("--batch-lines", type=int, default=2000)
    ap.add_argument("--batch-tokens", type=int, default=32, help="tokens of each batch line's answer")
    ap.add_argument("--repeats", type=int, default=2, help="phases of each kind, alternating")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--batch-seat-share", type=float, default=0.5, help="the gateway's --batch-seat-share")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    args = ap.parse_args()

    ttfts: dict[str, list[float]] = {"alone": [], "with batch": []}
    answered: list[int] = []
    preempted: dict[str, list[int]] = {"alone": [], "with batch": []}
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis_server:
        model = model_or_tiny(args.model, tmp)
        port, metrics_port = free_port(), free_port()
        procs = start_servers(args, redis_server.url, model, port, metrics_port)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            with task("phases", total=1 + 2 * args.repeats) as bar:
                asyncio.run(interactive(base, model, args.rate, min(args.duration, 3.0), args.max_tokens))  # warm-up
                bar.advance()
                for i in range(args.repeats):
                    for kind in ("alone", "with batch"):
                        bar.update(description=f"phases (repeat {i + 1}/{args.repeats}: {kind})")
                        before = preemptions(metrics_port)
                        got, lines = asyncio.run(phase(base, args, model, kind == "with batch"))
                        preempted[kind].append(preemptions(metrics_port) - before)
                        ttfts[kind] += got
                        if kind == "with batch":
                            answered.append(lines)
                        bar.advance()
        finally:
            stop_all(list(reversed(procs)), timeout=20)
    report(args, ttfts, answered, preempted)


def report(args: argparse.Namespace, ttfts: dict[str, list[float]], answered: list[int],
           preempted: dict[str, list[int]]) -> None:
    rows = {kind: {"p50_ms": percentile(v, 0.5) * 1e3, "p99_ms": percentile(v, 0.99) * 1e3, "requests": len(v)}
            for kind, v in ttfts.items()}
    print(f"interactive: {args.rate:g} streaming chat req/s for {args.duration:g} s, {args.max_tokens} tokens each; "
          f"batch: {args.batch_lines} lines of {args.batch_tokens} tokens (seat share {args.batch_seat_share:g}); "
          f"{args.repeats} phases of each kind")
    print(f"{'':14}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'requests':>10}")
    for kind, r in rows.items():
        print(f"{kind:14}{r['p50_ms']:12.1f}{r['p99_ms']:12.1f}{r['requests']:10d}")
    ratio = rows["with batch"]["p99_ms"] / rows["alone"]["p99_ms"]
    print(f"p99 with / without batch: {ratio:.3f}; batch lines answered during the load: {answered}; "
          f"preemptions per phase: {preempted}")
    if args.json:
        print(json.dumps({"ttft": rows, "p99_ratio": ratio, "batch_lines_answered": answered,
                          "preemptions": preempted}))


if __name__ == "__main__":
    main()
