"""Redis memory per request and per token: what one served request leaves in Redis until its keys
expire (--events-ttl), measured with MEMORY USAGE and INFO memory on a private redis-server.

    python -m bench.redis_memory [--requests 100] [--tokens 16,128] [--prompt-len 32] [--model tiny|PATH]

A real `streamer worker` (tiny random Llama by default) serves `--requests` requests per encoding
(json, msgpack) and per output length in `--tokens` (greedy, ignore_eos: each engine step yields one
token, so one event per token). For each run it prints the mean MEMORY USAGE (SAMPLES 0: exact) of a
request's events stream, of its `job:{id}` key, and of all the keys the request left (found by a SCAN
for its id: events, job, fence ...); the per-token cost is the slope of the events stream's size
between the two lengths. INFO's used_memory growth over all runs, per request, is printed as a
cross-check (it also counts allocator slack and buffers). It also fills a
dead-letter stream with worst-case entries (the longest reason, message, id, worker name and a full
--dead-payload-bytes payload spread over the most fields) to give a dead letter's largest size.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.machine import ROOT
from bench.harness.servers import child_env


def start_worker(ckpt: Path, url: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", str(ckpt), "--redis", url,
           "--num-kv-blocks", "2048", "--max-num-seqs", "128", "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(keep_streamer_vars=True))


def memory_usage(r, key: str) -> int:  # noqa: ANN001
    return int(r.memory_usage(key, samples=0) or 0)


async def serve(url: str, encoding: str, n: int, tokens: int, prompt_len: int, vocab: int, tag: str) -> list[str]:
    from clients.redis_client import AsyncClient
    from workers.progress_display import task

    rng = random.Random(0)
    params = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    async with AsyncClient(url, encoding=encoding) as client:
        async def one(i: int) -> str:
            prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
            g = await client.generate(prompt_token_ids=prompt, params=params, id=f"{tag}-{i:05d}", timeout=600)
            assert len(g.token_ids[0]) == tokens, g
            bar.advance()
            return g.id

        with task(f"requests ({tag})", total=n) as bar:
            return list(await asyncio.gather(*(one(i) for i in range(n))))


def dead_letter_worst_case(r, count: int = 1000) -> float:  # noqa: ANN001
    """Mean MEMORY USAGE per entry of a dead stream holding only the largest possible dead letters."""
    from workers.worker.answers import DEAD_FIELD_NAME_CHARS, DEAD_MESSAGE_CHARS, DEAD_PAYLOAD_FIELDS
    from workers.worker.config import WorkerConfig

    limit = WorkerConfig().dead_payload_bytes
    key = "memory-bench:dead"
    r.delete(key)
    rng = random.Random(1)
    for i in range(count):
        entry = {"reason": "too_many_deliveries", "message": "m" * DEAD_MESSAGE_CHARS,
                 "entry": f"{1_800_000_000_000 + i}-{2**31}", "worker": "w" * 64,
                 "time_ms": str(1_800_000_000_000 + i), "id": "i" * 127 + f"{i % 10}"}
        for f in range(DEAD_PAYLOAD_FIELDS):
            entry[f"payload_{f}" + "n" * (DEAD_FIELD_NAME_CHARS - 1)] = rng.randbytes(limit // DEAD_PAYLOAD_FIELDS)
        entry["payload_bytes"] = str(1 << 30)
        r.xadd(key, entry)
    size = memory_usage(r, key) / count
    r.delete(key)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--tokens", default="16,128", help="two output lengths, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--model", default="tiny", help="tiny (random Llama, 512 tokens) or a checkpoint dir")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "streamer-bench"))
    args = parser.parse_args()
    short, long = (int(t) for t in args.tokens.split(","))

    import redis
    from transformers import AutoConfig

    from clients.heartbeats import live_workers
    from clients.protocol import Names
    from workers.progress_display import task
    from workers.redis_server import RedisServer

    if args.model == "tiny":
        from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

        ckpt = Path(args.cache) / "llama-tiny-random"
        if not (ckpt / "config.json").exists():
            build_checkpoint(ckpt, TinyModelSpec(arch="llama"), seed=1)
    else:
        ckpt = Path(args.model)
    vocab = AutoConfig.from_pretrained(ckpt).vocab_size
    names = Names()
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        worker = start_worker(ckpt, server.url)
        try:
            with task("starting the worker"):
                while not live_workers(r, names):
                    if worker.poll() is not None:
                        raise RuntimeError("the worker exited during start-up")
                    time.sleep(0.1)
            rows = []
            # Untimed warm-up: the worker's connections, scripts and the server's own buffers grow
            # once, outside the measured batches.
            asyncio.run(serve(server.url, "json", 20, short, args.prompt_len, vocab, "warm-up"))
            served, before = 0, r.info("memory")["used_memory"]
            for encoding in ("json", "msgpack"):
                events = {}
                for tokens in (short, long):
                    tag = f"{encoding}-{tokens}"
                    ids = asyncio.run(serve(server.url, encoding, args.requests, tokens, args.prompt_len, vocab, tag))
                    while r.xlen(names.requests):  # every entry acked and deleted
                        time.sleep(0.05)
                    served += len(ids)
                    events[tokens] = sum(memory_usage(r, names.events(i)) for i in ids) / len(ids)
                    job = sum(memory_usage(r, names.job(i)) for i in ids) / len(ids)
                    keys = list(r.scan_iter(match=f"*:{tag}-*", count=1000))  # a benchmark may scan
                    kinds = sorted({k.decode().rsplit(":", 1)[0] for k in keys})
                    every = sum(memory_usage(r, k) for k in keys) / len(ids)
                    rows.append((encoding, tokens, events[tokens], job, every, f"{len(keys) / len(ids):g}: "
                                 + ", ".join(kinds)))
                per_token = (events[long] - events[short]) / (long - short)
                rows.append((encoding, "per token", per_token, None, None, ""))
            grown = (r.info("memory")["used_memory"] - before) / served
            dead = dead_letter_worst_case(r)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        r.close()
    print(f"model {ckpt.name}, {args.requests} requests per row, {args.prompt_len} prompt tokens, "
          f"redis-server {server_version()}\n")
    print("| encoding | output tokens | events stream (B) | job key (B) | all its keys (B) | keys per request |")
    print("|---|---|---|---|---|---|")
    for encoding, tokens, ev, job, every, kinds in rows:
        cells = [f"{ev:.0f}" if tokens != "per token" else f"{ev:.1f}",
                 "" if job is None else f"{job:.0f}", "" if every is None else f"{every:.0f}", kinds]
        print(f"| {encoding} | {tokens} | " + " | ".join(cells) + " |")
    print(f"\nINFO used_memory grew by {grown:.0f} B per request over the {served} measured requests")
    print(f"\nlargest dead letter: {dead:.0f} B each (MEMORY USAGE of 1000 worst-case entries / 1000)")


def server_version() -> str:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), "?")


if __name__ == "__main__":
    main()
