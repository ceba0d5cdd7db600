"""Gateway fan-out: how many concurrent WebSocket streams and token events/s one gateway relays, and
the latency it adds per event.

    python -m bench.fanout [--streams 100,400,1000] [--tokens 100] [--interval-ms 20] [--clients 2]

The engine is replaced by a fast fake producer (this benchmark only) that writes real events with the
worker's own EventWriter (XADD to `events:{id}` + PUBLISH to `tokens:{id}`, one pipeline per "step"
for every stream at once, as the engine's step loop does). Each token event's `text` carries the
producer's clock at the moment the step was handed to the writer; a client subtracts it from its own
clock (CLOCK_MONOTONIC, shared by processes on one machine) when it has parsed the frame.

For each stream count: the gateway runs as its own process (`streamer gateway`), producers are spread
over --producers processes (as several workers would be), clients over --clients processes, one
WebSocket per stream (one browser tab each); each sends a `generate` that the gateway pushes onto the
requests stream. Then every --interval-ms each producer emits one token for each of its streams
(0: back to back, to find the ceiling), --tokens per stream, then `done`. The gateway's CPU time over
the round gives its cost per event, whatever else shares the machine.
The same run with the clients subscribed to Redis pub/sub directly (`--direct`, no gateway) gives
the baseline; the difference is what the gateway adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

from bench.harness.machine import ROOT, cpu_seconds
from bench.harness.servers import child_env
from bench.harness.stats import percentile
from clients.events import done_event, token_event
from clients.protocol import Names
from workers.progress_display import task
from workers.redis_server import RedisServer, free_port
from workers.worker.event_writer import EventWriter, Write

NAMES = Names()


# --- clients (one process per slice of the streams) ------------------------------------------------

async def _client_ws(url: str, ids: list[str], ready: Any, go: Any) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    latencies: list[float] = []
    received = 0
    closes: dict[str, int] = {}

    async def one(rid: str, conn: Any) -> None:
        nonlocal received
        async for message in conn:
            now = time.perf_counter()
            event = json.loads(message)
            if event["type"] == "token":
                received += 1
                latencies.append(now - float(event["text"]))
            elif event["type"] in ("done", "error"):
                return

    conns = []
    for rid in ids:
        conn = await connect(url, max_queue=None, compression=None, open_timeout=60)
        await conn.send(json.dumps({"type": "generate", "id": rid, "prompt": "x", "params": {"max_tokens": 1}}))
        conns.append(conn)
    for conn in conns:  # every job is in Redis before the producer starts
        assert json.loads(await conn.recv())["type"] == "accepted"
    ready.set()
    await asyncio.to_thread(go.wait)
    results = await asyncio.gather(*(one(r, c) for r, c in zip(ids, conns, strict=True)), return_exceptions=True)
    for r in results:
        if isinstance(r, Exception):
            closes[type(r).__name__] = closes.get(type(r).__name__, 0) + 1
    last_at = time.perf_counter()
    await asyncio.gather(*(c.close() for c in conns))
    return {"latencies": latencies, "received": received, "failures": closes, "last_at": last_at}


async def _client_direct(redis_url: str, ids: list[str], ready: Any, go: Any) -> dict[str, Any]:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    await pubsub.subscribe(*(NAMES.tokens(i) for i in ids))
    latencies: list[float] = []
    left = set(ids)
    ready.set()
    await asyncio.to_thread(go.wait)
    deadline = time.monotonic() + 300
    while left and time.monotonic() < deadline:
        # None also stands for an (ignored) subscribe confirmation: keep reading until the deadline.
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
        if msg is None:
            continue
        now = time.perf_counter()
        event = json.loads(msg["data"])
        if event["type"] == "token":
            latencies.append(now - float(event["text"]))
        else:
            left.discard(event["id"])
    last_at = time.perf_counter()
    await pubsub.aclose()
    await r.aclose()
    return {"latencies": latencies, "received": len(latencies), "last_at": last_at,
            "failures": {"unfinished": len(left)} if left else {}}


def client_process(mode: str, target: str, ids: list[str], ready: Any, go: Any, out: Any) -> None:
    fn = _client_ws if mode == "ws" else _client_direct
    try:
        out.put(asyncio.run(fn(target, ids, ready, go)))
    except Exception as e:  # reported, so the parent does not wait forever
        out.put({"latencies": [], "received": 0, "last_at": time.perf_counter(),
                 "failures": {repr(e)[:200]: len(ids)}})
        ready.set()


# --- the fake producer -----------------------------------------------------------------------------

async def produce(redis_url: str, ids: list[str], tokens: int, interval: float) -> float:
    """One step = one token for every stream, handed to the worker's EventWriter. Returns the wall time
    from the first step to the last event written."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    writer = EventWriter(r, NAMES, events_ttl_ms=600_000)
    runner = asyncio.ensure_future(writer.run())
    start = time.perf_counter()
    for step in range(tokens + 1):
        now = time.perf_counter()
        for rid in ids:
            event = (token_event(rid, step, 0, [step], repr(now)) if step < tokens else
                     done_event(rid, step, ["length"], {"prompt_tokens": 1, "completion_tokens": tokens,
                                                        "cached_tokens": 0}))
            writer.put(Write(rid, "json", [event]))
        if interval:
            await asyncio.sleep(max(0.0, start + (step + 1) * interval - time.perf_counter()))
        else:
            await writer.wait_idle()  # back to back, but never more than one step queued
    writer.close()
    await runner
    wall = time.perf_counter() - start
    await r.aclose()
    return wall


def producer_process(redis_url: str, ids: list[str], tokens: int, interval: float, go: Any, out: Any) -> None:
    go.wait()
    out.put(asyncio.run(produce(redis_url, ids, tokens, interval)))


# --- one measurement -------------------------------------------------------------------------------

def run_round(mode: str, target: str, redis_url: str, streams: int, tokens: int, interval: float,
              clients: int, producers: int, tag: str, gateway_pid: int | None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ids = [f"{tag}-{i}" for i in range(streams)]
    slices = [ids[k::clients] for k in range(clients)]
    go, out, produced = ctx.Event(), ctx.Queue(), ctx.Queue()
    # Several producers, like several workers: one Python process alone tops out near 10k events/s.
    makers = [ctx.Process(target=producer_process, args=(redis_url, ids[k::producers], tokens, interval, go,
                                                          produced), daemon=True) for k in range(producers)]
    for p in makers:
        p.start()
    readies = [ctx.Event() for _ in slices]
    procs = [ctx.Process(target=client_process, args=(mode, target, s, ev, go, out), daemon=True)
             for s, ev in zip(slices, readies, strict=True)]
    for p in procs:
        p.start()
    for ev in readies:
        if not ev.wait(300):
            raise TimeoutError("clients did not connect")
    cpu0 = cpu_seconds(gateway_pid)
    started = time.perf_counter()
    go.set()
    for _ in makers:
        produced.get(timeout=300)
    parts = [out.get(timeout=300) for _ in procs]
    # From the first step to the last event in a client's hands (CLOCK_MONOTONIC is machine-wide).
    wall = max(part["last_at"] for part in parts) - started
    gateway_cpu = cpu_seconds(gateway_pid) - cpu0
    for p in procs + makers:
        p.join(30)
    lat = [x for part in parts for x in part["latencies"]]
    failures: dict[str, int] = {}
    for part in parts:
        for k, v in part["failures"].items():
            failures[k] = failures.get(k, 0) + v
    received = sum(part["received"] for part in parts)
    return {"mode": "gateway" if mode == "ws" else "redis-direct", "streams": streams, "tokens": tokens,
            "interval_ms": interval * 1e3, "events": received, "expected": streams * tokens,
            "events_per_s": received / wall, "wall_s": wall,
            "p50_ms": 1e3 * statistics.median(lat) if lat else float("nan"),
            "p99_ms": 1e3 * percentile(lat, 0.99), "max_ms": 1e3 * max(lat, default=float("nan")),
            # Events the gateway could relay per second of one core: its capacity, whatever else runs.
            "events_per_cpu_s": received / gateway_cpu if mode == "ws" and gateway_cpu > 0 else float("nan"),
            "failures": failures}


def start_gateway(redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = child_env(keep_streamer_vars=True)
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "gateway", "--port", str(port), "--redis",
                             redis_url, "--log-level", "WARNING", "--cancel-grace", "60"],
                            cwd=ROOT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
            return proc, f"ws://127.0.0.1:{port}/ws"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("gateway did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="100,400,1000", help="comma-separated concurrent stream counts")
    ap.add_argument("--tokens", type=int, default=100, help="token events per stream")
    ap.add_argument("--interval-ms", type=float, default=20.0,
                    help="time between steps (20 ms = 50 tokens/s per stream); 0 = as fast as possible")
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--producers", type=int, default=2, help="fake producer processes")
    ap.add_argument("--direct", action="store_true", help="also run each round with clients on Redis "
                                                          "pub/sub directly (the baseline without the gateway)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON lines too")
    args = ap.parse_args()
    rows = []
    with RedisServer() as redis_server:
        gateway, ws_url = start_gateway(redis_server.url)
        counts = [int(s) for s in args.streams.split(",")]
        try:
            with task("rounds", total=len(counts) * (2 if args.direct else 1)) as bar:
                for i, n in enumerate(counts):
                    modes = [("ws", ws_url)] + ([("direct", redis_server.url)] if args.direct else [])
                    for mode, target in modes:
                        bar.update(description=f"rounds ({n} streams, {mode})")
                        row = run_round(mode, target, redis_server.url, n, args.tokens, args.interval_ms / 1e3,
                                        args.clients, args.producers, f"{mode}{i}",
                                        gateway.pid if mode == "ws" else None)
                        rows.append(row)
                        bar.advance()
                        if args.json:
                            print(json.dumps(row), flush=True)
                bar.update(description="rounds")
        finally:
            gateway.terminate()
            gateway.wait(10)
    cpus = os.cpu_count()
    print(f"\nfan-out, {cpus} CPUs, step every {args.interval_ms:g} ms, {args.tokens} tokens per stream, "
          f"{args.clients} client and {args.producers} producer processes")
    print(f"{'path':<13}{'streams':>8}{'events':>9}{'events/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'ev/CPU-s':>10}  failures")
    for r in rows:
        print(f"{r['mode']:<13}{r['streams']:>8}{r['events']:>9}{r['events_per_s']:>10.0f}{r['p50_ms']:>9.1f}"
              f"{r['p99_ms']:>9.1f}{r['max_ms']:>9.1f}{r['events_per_cpu_s']:>10.0f}  {r['failures'] or '-'}"
              + ("" if r["events"] == r["expected"] else f"  (expected {r['expected']})"))


if __name__ == "__main__":
    main()
