"""Tensor-parallel scaling: output tokens/s of the same workload at TP = 1, 2, 4, ...

    python -m bench.tp_scaling [--sizes 1,2,4] [--requests 32] [--model DIR] [--dtype bfloat16]

Each size runs in a fresh engine (rank processes started and joined by the engine) on the
~110M-parameter random Llama of bench/harness/workload.py unless --model is given. Greedy decoding with
ignore_eos, so every size produces the same number of tokens; the table also says how many
requests produced exactly TP = 1's tokens (float32: all of them; bfloat16 sums in another order
across ranks, so an occasional near-tie may flip). Default sizes: powers of two up to the
visible GPUs, or 1 and 2 on CPU, where the ranks share the cores and the numbers only show
correctness and the per-step overhead of the broadcast and the all-reduces.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.harness.workload import Workload, bench_checkpoint, make_workload, submit_greedy, warm_up
from streamer import LLMEngine
from streamer.config import EngineConfig
from workers.progress_display import task


def run(ckpt: Path, tp: int, work: Workload, args: argparse.Namespace) -> dict:
    with task(f"starting the engine (TP={tp})"):  # (its start and end not timed)
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=str(ckpt), dtype=args.dtype, device=args.device,
                                        tensor_parallel_size=tp, max_num_seqs=args.max_num_seqs,
                                        num_kv_blocks=args.num_kv_blocks))
        startup = time.perf_counter() - start
    try:
        warm_up(engine, work.prompts[0][:16])  # also the first collectives under tensor parallelism
        submit_greedy(engine, work)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(work.prompts))}
        steps = 0
        with task(f"requests (TP={tp})", total=len(work.prompts)) as bar:
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] += out.outputs[0].token_ids
                    if out.finished:
                        bar.advance()
                steps += 1
            elapsed = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.shutdown()
    generated = sum(map(len, tokens.values()))
    return {"tp": tp, "startup_s": startup, "seconds": elapsed, "tokens": generated,
            "tok_per_s": generated / elapsed, "ms_per_step": 1000 * elapsed / steps,
            "kv_blocks": stats["kv_blocks_total"], "preemptions": stats["num_preemptions"],
            "outputs": [tokens[str(i)] for i in range(len(work.prompts))]}


def default_sizes(device: str | None) -> list[int]:
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if gpus == 0:
        return [1, 2]
    return [n for n in (1, 2, 4, 8) if n <= gpus]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", help="comma-separated TP sizes (default: see above)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=128)
    ap.add_argument("--model", help="checkpoint directory (default: the random 110M Llama)")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, the checkpoint's on GPU")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    ckpt = Path(args.model) if args.model else bench_checkpoint(Path.home() / ".cache" / "streamer-bench")
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    work = make_workload(args.requests, vocab, min_out=args.max_out // 4, max_out=args.max_out)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes(args.device)
    results = []
    for tp in sizes:
        try:
            results.append(run(ckpt, tp, work, args))
        except ValueError as exc:  # this model does not split that many ways, or too few GPUs
            print(f"TP={tp}: skipped ({exc})", file=sys.stderr)
    outputs = [r.pop("outputs") for r in results]
    for r, out in zip(results, outputs):
        r["speedup"] = r["tok_per_s"] / results[0]["tok_per_s"]
        r["same_tokens_as_first"] = sum(a == b for a, b in zip(out, outputs[0]))
    device = torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    if args.json:
        print(json.dumps({"device": device, "model": str(ckpt), "requests": args.requests, "results": results}))
        return
    print(f"{args.requests} requests, outputs {args.max_out // 4}-{args.max_out} tokens, {device}, {ckpt.name}")
    print(f"{'TP':>3} {'startup s':>9} {'tok/s':>9} {'speedup':>8} {'ms/step':>8} {'KV blocks':>10} "
          f"{'preempt':>8} {'same tokens':>12}")
    for r in results:
        print(f"{r['tp']:>3} {r['startup_s']:>9.1f} {r['tok_per_s']:>9.1f} {r['speedup']:>8.2f} "
              f"{r['ms_per_step']:>8.1f} {r['kv_blocks']:>10} {r['preemptions']:>8} "
              f"{r['same_tokens_as_first']:>6}/{args.requests}")


if __name__ == "__main__":
    main()
