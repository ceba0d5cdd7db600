"""KV sharing: prefix caching on a shared-prefix chat workload, and parallel sampling (n=4)
with shared prompt blocks vs independent requests. Same checkpoint, same run.

    python -m bench.kv_sharing [--requests 32] [--prefix 200] [--small]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench.harness.machine import CACHE_DIR
from bench.harness.workload import bench_checkpoint, make_workload
from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint
from workers.progress_display import Task, task


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], label: str) -> dict:
    """All requests arrive at once; returns throughput, mean time to first token, peak blocks."""
    with task(f"requests ({label})", total=len(prompts)) as bar:
        return _run(engine, prompts, params, bar)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], bar: Task) -> dict:
    start = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    first: dict[str, float] = {}
    tokens, peak = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                bar.advance()
        peak = max(peak, engine.stats()["kv_blocks_used"])
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "ttft_ms": 1000 * sum(first.values()) / len(first), "peak_blocks": peak,
            "seconds": elapsed}


def engine_for(ckpt: Path, caching: bool, warm: list[int] | None = None) -> LLMEngine:
    """A fresh engine after one untimed request (by default a trivial one; for the chat
    workload the system prompt, as a server that has already served one conversation)."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), enable_prefix_caching=caching, num_kv_blocks=4096))
    engine.add_request("warm", {"prompt_token_ids": warm or [5, 6, 7]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="a tiny random model instead of the 110M one")
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = ap.parse_args()
    if args.small:
        ckpt = args.cache_dir / "tiny"
        if not (ckpt / "model.safetensors").exists():
            build_checkpoint(ckpt, TinyModelSpec(), seed=0)
        vocab = 512
    else:
        ckpt, vocab = bench_checkpoint(args.cache_dir), 32000
    rng = random.Random(0)
    system = [rng.randrange(8, vocab) for _ in range(args.prefix)]
    prompts = [system + [rng.randrange(8, vocab) for _ in range(rng.randint(8, 24))] for _ in range(args.requests)]
    greedy = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)] * args.requests

    print(f"shared-prefix chat: {args.requests} requests, {args.prefix}-token common prefix, "
          f"{args.max_tokens} output tokens each")
    on = run(engine_for(ckpt, True, system), prompts, greedy, "shared prefix, caching on")
    off = run(engine_for(ckpt, False, system), prompts, greedy, "shared prefix, caching off")
    print(f"  prefix caching on : {on['tok_s']:8.1f} tok/s  mean TTFT {on['ttft_ms']:8.1f} ms")
    print(f"  prefix caching off: {off['tok_s']:8.1f} tok/s  mean TTFT {off['ttft_ms']:8.1f} ms")
    print(f"  ratio on/off: throughput {on['tok_s'] / off['tok_s']:.2f}x, "
          f"TTFT {off['ttft_ms'] / on['ttft_ms']:.2f}x faster")

    # Cost of caching when nothing hits: distinct prompts, caching on vs off.
    work = make_workload(args.requests, vocab, min_out=args.max_tokens, max_out=args.max_tokens, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    miss_on = run(engine_for(ckpt, True), work.prompts, params, "distinct prompts, caching on")
    miss_off = run(engine_for(ckpt, False), work.prompts, params, "distinct prompts, caching off")
    print(f"no hits (distinct prompts): on {miss_on['tok_s']:.1f} tok/s vs off {miss_off['tok_s']:.1f} tok/s "
          f"({100 * (miss_on['tok_s'] / miss_off['tok_s'] - 1):+.1f}%)")

    # Parallel sampling n=4: one request sharing its prompt vs four independent requests.
    n, prompt = 4, prompts[0]
    sample = dict(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    shared = run(engine_for(ckpt, False), [prompt], [SamplingParams(n=n, seed=1, **sample)], f"n={n} shared")
    separate = run(engine_for(ckpt, False), [prompt] * n, [SamplingParams(seed=1 + i, **sample) for i in range(n)],
                   f"n={n} independent")
    saved = 1 - shared["peak_blocks"] / separate["peak_blocks"]
    print(f"n={n} parallel sampling, {len(prompt)}-token prompt: peak KV blocks {shared['peak_blocks']} shared vs "
          f"{separate['peak_blocks']} independent ({100 * saved:.0f}% less)")


if __name__ == "__main__":
    main()
