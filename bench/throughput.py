"""Offline throughput: streamer vs transformers static batching, same checkpoint, same run.

    python -m bench.throughput [--requests 64] [--dtype float32] [--hf-batch 16] [--skip-hf]

Prints output tokens/s of both and the ratio, plus peak KV utilisation against what
pre-allocating max length per request would use.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.harness.machine import CACHE_DIR
from bench.harness.workload import Workload, bench_checkpoint, make_workload, submit_greedy, warm_up
from streamer import LLMEngine
from streamer.config import EngineConfig
from workers.progress_display import task


def run_streamer(ckpt: Path, work: Workload, dtype: str, max_num_seqs: int, max_batched: int) -> dict:
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype=dtype, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_batched, num_kv_blocks=None))
    warm_up(engine, work.prompts[0][:16])  # also the first collectives under tensor parallelism
    submit_greedy(engine, work)
    peak_used, peak_util = 0, 0.0
    generated = 0
    with task("requests (streamer)", total=len(work.prompts)) as bar:  # (its start and end not timed)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                generated += len(out.outputs[0].token_ids)
                if out.finished:
                    bar.advance()
            stats = engine.stats()
            if stats["kv_blocks_used"] > peak_used:
                peak_used, peak_util = stats["kv_blocks_used"], stats["kv_utilization"]
        elapsed = time.perf_counter() - start
    bs = engine.config.block_size
    prealloc_slots = len(work.prompts) * engine.max_model_len
    return {"tokens": generated, "seconds": elapsed, "tok_per_s": generated / elapsed,
            "peak_kv_blocks": peak_used, "kv_util_at_peak": peak_util,
            "peak_kv_slots": peak_used * bs, "prealloc_max_len_slots": prealloc_slots,
            "needed_slots": sum(len(p) + n for p, n in zip(work.prompts, work.output_lens)),
            "preemptions": engine.stats()["num_preemptions"]}


def run_hf(ckpt: Path, work: Workload, dtype: str, batch: int, device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).to(device).eval()
    useful = 0
    with task(f"requests (transformers, batches of {batch})", total=len(work.prompts)) as bar:
        start = time.perf_counter()
        for b in range(0, len(work.prompts), batch):
            prompts = work.prompts[b:b + batch]
            outs = work.output_lens[b:b + batch]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                               do_sample=False, pad_token_id=0)
            useful += sum(outs)  # a static batch runs to its longest request; only requested tokens count
            bar.advance(len(prompts))
        elapsed = time.perf_counter() - start
    return {"tokens": useful, "seconds": elapsed, "tok_per_s": useful / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    ckpt = bench_checkpoint(args.cache_dir)
    work = make_workload(args.requests, 32000)
    print(f"workload: {args.requests} requests, prompt mean {sum(map(len, work.prompts)) / len(work.prompts):.0f} "
          f"tokens, {work.total_output_tokens} output tokens, dtype {args.dtype}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    ours = run_streamer(ckpt, work, args.dtype, args.max_num_seqs, args.max_num_batched_tokens)
    print(f"streamer: {ours['tok_per_s']:.1f} output tok/s ({ours['tokens']} tokens in {ours['seconds']:.1f} s)")
    print(f"  peak KV: {ours['peak_kv_slots']} slots allocated ({ours['kv_util_at_peak']:.1%} holding tokens) vs "
          f"{ours['prealloc_max_len_slots']} if every request pre-allocated max_model_len "
          f"({ours['peak_kv_slots'] / ours['prealloc_max_len_slots']:.1%}); preemptions {ours['preemptions']}",
          flush=True)
    result = {"streamer": ours, "args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_hf:
        hf = run_hf(ckpt, work, args.dtype, args.hf_batch)
        print(f"transformers static batching (batch {args.hf_batch}): {hf['tok_per_s']:.1f} output tok/s "
              f"({hf['seconds']:.1f} s)")
        print(f"ratio streamer / transformers: {ours['tok_per_s'] / hf['tok_per_s']:.2f}x")
        result["transformers"] = hf
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
