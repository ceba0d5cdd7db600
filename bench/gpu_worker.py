"""The Redis worker serving 64 concurrent jobs (step 5 of bench/gpu_check.py).

    python -m bench.gpu_worker [--smoke]

A private redis-server, a `streamer worker` process on the device and 64 jobs submitted at once
through the Python client, beside the same jobs through an in-process AsyncEngine
(bench/transport.py, one run of each). Every job must come back whole. The KV cache is a fixed
number of blocks: the worker and the in-process engine share the device, and each sizing itself
from free memory would leave the second one nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bench.harness.workload import make_workload
from bench.transport import resolve_model, run_both

JOBS = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, short jobs")
    cli = parser.parse_args()
    from transformers import AutoConfig

    from workers.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        args = argparse.Namespace(requests=JOBS, prompt_len=32 if cli.smoke else 128,
                                  max_tokens=8 if cli.smoke else 64, kv_blocks=256 if cli.smoke else 2048,
                                  dtype=None if cli.smoke else "bfloat16", encoding="msgpack", repeat=1, cache=tmp)
        ckpt = resolve_model("tiny" if cli.smoke else "bench", Path(tmp))
        vocab = AutoConfig.from_pretrained(ckpt).vocab_size
        work = make_workload(JOBS, vocab, mean_prompt=args.prompt_len, min_out=args.max_tokens,
                             max_out=args.max_tokens).prompts
        with RedisServer() as server:
            local, redis = asyncio.run(run_both(ckpt, work, args, server.url))
    expected = JOBS * args.max_tokens
    ok = redis["tokens"] == expected and local["tokens"] == expected
    summary = (f"{JOBS} jobs, {redis['tokens']}/{expected} tokens back; {redis['tokens_per_s']:.0f} tok/s "
               f"(in-process {local['tokens_per_s']:.0f}); TTFT p50 {redis['ttft_p50_ms']:.0f} ms, "
               f"per-token p50 {redis['tpot_p50_ms']:.1f} ms")
    print(summary)
    print("RESULT " + json.dumps({"ok": ok, "summary": summary, "redis": redis, "in_process": local}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
