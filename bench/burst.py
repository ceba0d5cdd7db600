"""Burst: many WebSocket streams sending their `generate` at the same moment through one gateway.

    python -m bench.burst [--streams 5000] [--clients 4] [--max-tokens 4] [--redis-max-connections 64]

Everything is real and runs on this machine: a private redis-server, one `streamer worker` on a tiny
random checkpoint (or --model), one `streamer gateway`, and --clients processes holding --streams
WebSockets between them. All sockets are opened first; then every client sends one `generate` per
socket at once (a barrier across processes) and reads until `done`. Reported: errors (error frames by
code, failed or closed sockets, streams that never finished), time to `accepted` and to the first
token (p50/p99, from the moment the frame was sent), and the total time from the burst to the last
`done`. The gateway's Redis pool is the thing under test: before it queued, a burst past its 100
connections failed with `redis_unavailable`.

--gateway-root DIR runs the gateway (only) from another checkout of this repository, e.g. an older
commit unpacked with `git archive COMMIT | tar -x -C DIR`, to compare before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness.machine import ROOT, cpu_seconds, model_or_tiny
from bench.harness.servers import child_env, http_ok, stop_all, wait_for
from bench.harness.stats import percentile
from clients.heartbeats import live_workers
from clients.protocol import Names
from workers.progress_display import task
from workers.redis_server import RedisServer, free_port

# --- clients (one process per slice of the streams) ------------------------------------------------

async def _client(url: str, ids: list[str], params: dict[str, Any], ready: Any, go: Any,
                  timeout_s: float) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    errors: dict[str, int] = {}
    accepted: list[float] = []
    first: list[float] = []
    done_at: list[float] = []
    opening = asyncio.Semaphore(100)  # a connect storm would only overflow the listen backlog

    async def open_one() -> Any:
        async with opening:
            return await connect(url, max_queue=None, compression=None, open_timeout=120, ping_interval=None)

    conns = await asyncio.gather(*(open_one() for _ in ids), return_exceptions=True)
    for c in conns:
        if isinstance(c, BaseException):
            errors[f"connect {type(c).__name__}"] = errors.get(f"connect {type(c).__name__}", 0) + 1

    async def one(rid: str, conn: Any) -> None:
        sent = time.perf_counter()
        await conn.send(json.dumps({"type": "generate", "id": rid, "prompt": "Hello", "params": params}))
        got_first = False
        async for message in conn:
            now = time.perf_counter()
            frame = json.loads(message)
            kind = frame["type"]
            if kind == "accepted":
                accepted.append(now - sent)
            elif kind == "token" and not got_first:
                got_first = True
                first.append(now - sent)
            elif kind == "error":
                code = f"{frame.get('source', 'worker')}:{frame['code']}"
                errors[code] = errors.get(code, 0) + 1
                return
            elif kind == "done":
                done_at.append(now)
                return
        errors["closed"] = errors.get("closed", 0) + 1

    live = [(rid, c) for rid, c in zip(ids, conns, strict=True) if not isinstance(c, BaseException)]
    ready.set()
    await asyncio.to_thread(go.wait)
    started = time.perf_counter()
    tasks = [asyncio.ensure_future(one(rid, c)) for rid, c in live]
    finished, unfinished = await asyncio.wait(tasks, timeout=timeout_s)
    for t in unfinished:
        t.cancel()
    if unfinished:
        errors["unfinished"] = len(unfinished)
    for t in finished:
        if t.exception() is not None:
            name = type(t.exception()).__name__
            errors[name] = errors.get(name, 0) + 1
    await asyncio.gather(*(c.close() for _, c in live), return_exceptions=True)
    return {"started": started, "accepted": accepted, "first": first, "done_at": done_at, "errors": errors,
            "finished": len(done_at)}


def client_process(url: str, ids: list[str], params: dict[str, Any], ready: Any, go: Any, timeout_s: float,
                   out: Any) -> None:
    out.put(asyncio.run(_client(url, ids, params, ready, go, timeout_s)))


# --- servers -----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=5000)
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Llama)")
    ap.add_argument("--redis-max-connections", type=int, default=None,
                    help="the gateway's --redis-max-connections (default: its own default)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds the streams may take")
    ap.add_argument("--gateway-root", type=Path, default=ROOT, help="checkout the gateway runs from")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    args = ap.parse_args()

    params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis_server:
        model = model_or_tiny(args.model, tmp)
        procs: list[subprocess.Popen] = []
        port = free_port()
        try:
            worker = [sys.executable, "-m", "workers.cli", "worker", "--model", model, "--redis", redis_server.url,
                      "--device", args.device, "--num-kv-blocks", str(args.num_kv_blocks),
                      "--max-num-seqs", str(args.max_num_seqs), "--log-level", "WARNING"]
            procs.append(subprocess.Popen(worker, cwd=ROOT, env=child_env()))
            client = redis.Redis.from_url(redis_server.url)
            with task("starting the worker"):
                wait_for(lambda: bool(live_workers(client, Names())), "the worker", procs)
            gateway = [sys.executable, "-m", "workers.cli", "gateway", "--port", str(port), "--redis",
                       redis_server.url, "--max-connections", str(args.streams + 100), "--log-level", "WARNING"]
            if args.redis_max_connections is not None:
                gateway += ["--redis-max-connections", str(args.redis_max_connections)]
            procs.append(subprocess.Popen(gateway, cwd=args.gateway_root, env=child_env(args.gateway_root)))
            wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), "the gateway", procs)

            ctx = mp.get_context("spawn")
            go, out = ctx.Event(), ctx.Queue()
            share = [list(range(i, args.streams, args.clients)) for i in range(args.clients)]
            readies, children = [], []
            for n, part in enumerate(share):
                ready = ctx.Event()
                ids = [f"b{n}-{i}" for i in part]
                p = ctx.Process(target=client_process, args=(f"ws://127.0.0.1:{port}/ws", ids, params, ready, go,
                                                             args.timeout, out))
                p.start()
                readies.append(ready)
                children.append(p)
            with task(f"client processes ready ({args.streams} sockets)", total=len(readies)) as bar:
                for ready in readies:
                    if not ready.wait(600):
                        raise SystemExit("clients did not open their sockets in time")
                    bar.advance()
            time.sleep(0.5)
            cpu_before = [cpu_seconds(p.pid) for p in procs]
            go.set()
            results = []
            end = time.monotonic() + args.timeout + 120
            with task("client processes finished (the burst)", total=len(children)) as bar:
                while len(results) < len(children):
                    try:
                        results.append(out.get(timeout=1))
                        bar.advance()
                    except queue.Empty:
                        dead = [(name, p.returncode) for name, p in zip(("worker", "gateway"), procs, strict=True)
                                if p.poll() is not None]
                        if dead or time.monotonic() > end:
                            for c in children:
                                c.terminate()
                            why = f"servers exited {dead}" if dead else "the clients hang"
                            raise SystemExit(f"gave up: {why}") from None
            cpu_used = [cpu_seconds(p.pid) - before for p, before in zip(procs, cpu_before, strict=True)]
            for p in children:
                p.join(30)
        finally:
            stop_all(list(reversed(procs)), timeout=20)

    errors: dict[str, int] = {}
    for res in results:
        for k, v in res["errors"].items():
            errors[k] = errors.get(k, 0) + v
    accepted = [x for res in results for x in res["accepted"]]
    first = [x for res in results for x in res["first"]]
    start = min(res["started"] for res in results)
    last = max((x for res in results for x in res["done_at"]), default=float("nan"))
    finished = sum(res["finished"] for res in results)
    summary = {"streams": args.streams, "finished": finished, "errors": errors,
               "accepted_p50_ms": round(percentile(accepted, 0.5) * 1000, 1),
               "accepted_p99_ms": round(percentile(accepted, 0.99) * 1000, 1),
               "ttft_p50_ms": round(percentile(first, 0.5) * 1000, 1),
               "ttft_p99_ms": round(percentile(first, 0.99) * 1000, 1),
               "ttft_mean_ms": round(statistics.fmean(first) * 1000, 1) if first else None,
               "total_s": round(last - start, 2), "worker_cpu_s": round(cpu_used[0], 2),
               "gateway_cpu_s": round(cpu_used[1], 2)}
    print(f"{args.streams} streams, {args.clients} client processes, max_tokens {args.max_tokens}: "
          f"{finished} finished, errors {errors or 'none'}")
    print(f"  accepted  p50 {summary['accepted_p50_ms']} ms  p99 {summary['accepted_p99_ms']} ms")
    print(f"  1st token p50 {summary['ttft_p50_ms']} ms  p99 {summary['ttft_p99_ms']} ms")
    print(f"  total     {summary['total_s']} s from the burst to the last done")
    print(f"  CPU       gateway {summary['gateway_cpu_s']} s, worker {summary['worker_cpu_s']} s (during the burst)")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
