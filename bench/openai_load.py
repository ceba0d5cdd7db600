"""Load through the gateway: N concurrent streaming chat completions over the OpenAI API (the official
`openai` async client, SSE) and the same N over `/ws`, in the same run, alternating.

    python -m bench.openai_load [--concurrency 64] [--max-tokens 64] [--repeats 3] [--model DIR]

Everything is real and on this machine: a private redis-server, one `streamer worker` (a tiny random
Llama unless --model), one `streamer gateway`, and the clients in this process. Each round sends
--concurrency chat requests at once (greedy, `ignore_eos`, the same messages on both paths) and reads
every stream to its end. Reported per path (median over the repeats): time to the first content token
(p50/p99, from the request being sent), inter-token latency (mean gap between a stream's token
deliveries, p50/p99 over streams), output tokens/s over the round, and the gateway's CPU per relayed
event (its user+system time during the round / the worker events it relayed), so the two protocols'
cost in the gateway is compared on the same events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import redis

from bench.harness.machine import ROOT, cpu_seconds, model_or_tiny
from bench.harness.servers import child_env, http_ok, stop_all, wait_for
from bench.harness.stats import percentile
from clients.heartbeats import live_workers
from clients.protocol import Names
from workers.progress_display import task
from workers.redis_server import RedisServer, free_port

PATHS = ("openai", "sse", "ws")  # the SDK, plain SSE over httpx, /ws
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a short story about a lighthouse keeper."}]


class Stream:
    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.deliveries: list[float] = []  # when each token-carrying message arrived
        self.tokens = 0

    def got(self, tokens: int) -> None:
        self.deliveries.append(time.perf_counter())
        self.tokens += tokens

    @property
    def ttft(self) -> float:
        return self.deliveries[0] - self.sent

    @property
    def itl(self) -> float | None:
        gaps = [b - a for a, b in zip(self.deliveries, self.deliveries[1:])]
        return statistics.fmean(gaps) if gaps else None


async def openai_round(base_url: str, model: str, n: int, max_tokens: int) -> list[Stream]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
        async def one() -> Stream:
            s = Stream()
            chunks = await client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    s.got(1)  # one token event of the worker becomes one chunk
                elif chunk.usage is not None:
                    s.tokens = chunk.usage.completion_tokens
            return s

        return list(await asyncio.gather(*(one() for _ in range(n))))


async def sse_round(base_url: str, model: str, n: int, max_tokens: int) -> list[Stream]:
    """The same requests as `openai_round`, read as plain SSE with httpx: the server's cost without the
    SDK's (pydantic models for every chunk) in the client."""
    import httpx

    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=n + 8)) as http:
        async def one() -> Stream:
            s = Stream()
            async with http.stream("POST", "/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                        s.got(1)
            return s

        streams = list(await asyncio.gather(*(one() for _ in range(n))))
    for s in streams:
        s.tokens = len(s.deliveries)  # one token per event at this batch size; counted exactly by openai_round
    return streams


async def ws_round(ws_url: str, n: int, max_tokens: int) -> list[Stream]:
    from websockets.asyncio.client import connect

    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def one() -> Stream:
        async with connect(ws_url, max_size=None) as ws:
            s = Stream()
            await ws.send(json.dumps({"type": "generate", "id": uuid.uuid4().hex, "messages": MESSAGES,
                                      "params": params}))
            async for raw in ws:
                frame = json.loads(raw)
                if frame["type"] == "token":
                    s.got(len(frame["token_ids"]))
                elif frame["type"] in ("done", "error"):
                    if frame["type"] == "error":
                        raise RuntimeError(frame)
                    return s
        raise RuntimeError("socket closed before done")

    return list(await asyncio.gather(*(one() for _ in range(n))))


def summarize(streams: list[Stream], wall_s: float, gateway_cpu_s: float, client_cpu_s: float) -> dict[str, float]:
    ttft = [s.ttft for s in streams]
    itl = [x for s in streams if (x := s.itl) is not None]
    events = sum(len(s.deliveries) + 1 for s in streams)  # token events + the final one
    return {"ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
            "itl_p50_ms": percentile(itl, 0.5) * 1e3, "itl_p99_ms": percentile(itl, 0.99) * 1e3,
            "tokens_per_s": sum(s.tokens for s in streams) / wall_s, "wall_s": wall_s,
            "gateway_us_per_event": gateway_cpu_s / events * 1e6, "client_us_per_event": client_cpu_s / events * 1e6}


def run_round(path: str, args: argparse.Namespace, port: int, model: str, gateway_pid: int) -> dict[str, float]:
    before, start, client_before = cpu_seconds(gateway_pid), time.perf_counter(), time.process_time()
    base = f"http://127.0.0.1:{port}/v1"
    if path == "openai":
        streams = asyncio.run(openai_round(base, model, args.concurrency, args.max_tokens))
    elif path == "sse":
        streams = asyncio.run(sse_round(base, model, args.concurrency, args.max_tokens))
    else:
        streams = asyncio.run(ws_round(f"ws://127.0.0.1:{port}/ws", args.concurrency, args.max_tokens))
    return summarize(streams, time.perf_counter() - start, cpu_seconds(gateway_pid) - before,
                     time.process_time() - client_before)


def start_servers(args: argparse.Namespace, redis_url: str, model: str, port: int) -> list[subprocess.Popen]:
    worker = [sys.executable, "-m", "workers.cli", "worker", "--model", model, "--redis", redis_url,
              "--device", args.device, "--max-num-seqs", str(max(args.concurrency, 8)), "--log-level", "WARNING"]
    procs = [subprocess.Popen(worker, cwd=ROOT, env=child_env())]
    client = redis.Redis.from_url(redis_url)
    with task("starting the worker"):  # (not the gateway: its banner would cut into the bar)
        wait_for(lambda: bool(live_workers(client, Names())), "the worker", procs)
    gateway = [sys.executable, "-m", "workers.cli", "gateway", "--port", str(port), "--redis", redis_url,
               "--log-level", "WARNING"]
    procs.append(subprocess.Popen(gateway, cwd=ROOT, env=child_env()))
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), "the gateway", procs)
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--paths", default=None, help=f"comma-separated subset of {','.join(PATHS)} (e.g. to profile one)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    args = ap.parse_args()

    results: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    paths = PATHS if args.paths is None else tuple(args.paths.split(","))
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis_server:
        model = model_or_tiny(args.model, tmp)
        port = free_port()
        procs = start_servers(args, redis_server.url, model, port)
        try:
            with task("rounds (warm-up)", total=1 + args.repeats * len(paths)) as bar:
                run_round("ws", args, port, model, procs[1].pid)  # warm-up: kernels, caches, connections
                bar.advance()
                for i in range(args.repeats):
                    for path in paths:
                        bar.update(description=f"rounds (repeat {i + 1}/{args.repeats}: {path})")
                        results[path].append(run_round(path, args, port, model, procs[1].pid))
                        bar.advance()
                bar.update(description="rounds")
        finally:
            stop_all(list(reversed(procs)), timeout=20)
    report(args, results)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    nan = dict.fromkeys(["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s",
                         "gateway_us_per_event", "client_us_per_event"], float("nan"))
    median = {path: {k: statistics.median(r[k] for r in runs) for k in runs[0]} if runs else nan
              for path, runs in results.items()}
    print(f"{args.concurrency} concurrent streaming chat requests, {args.max_tokens} tokens each, "
          f"median of {args.repeats} rounds per path")
    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s", "gateway_us_per_event",
            "client_us_per_event"]
    print(f"{'':24}{'openai SDK':>12}{'SSE/httpx':>12}{'/ws':>12}{'SDK/ws':>8}{'SSE/ws':>8}")
    for k in keys:
        a, b, c = median["openai"][k], median["sse"][k], median["ws"][k]
        print(f"{k:24}{a:12.1f}{b:12.1f}{c:12.1f}{_ratio(a, c):8.2f}{_ratio(b, c):8.2f}")
    if args.json:
        print(json.dumps(median))


if __name__ == "__main__":
    main()
