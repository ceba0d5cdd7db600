"""Multi-LoRA throughput: batches mixing 4 adapters against the base model alone, in the same run.

    python -m bench.lora [--model DIR] [--dtype bfloat16] [--rank 16] [--rounds 5] [--repeats 1]
                         [--workload main] [--requests 64] [--skip-workload] [--torch-path]
                         [--products] [--vllm-python VENV/bin/python --anchors ANCHORS_DIR]

Two measures, each alternating the three ways of running the same requests: every request on the base
model (`base`); every request under one of 4 adapters, request i under adapter i mod 4 (`4 adapters`);
base and the 4 adapters mixed, i mod 5 (`4 adapters + base`). The adapters are random PEFT adapters
of rank --rank on all seven projections (q, k, v, o, gate, up, down), built here with `peft`
(installed with the test extras), on the built-in SmolLM2-135M-Instruct (or --model).

1. Decode steps (the part the adapters cost most, and robust on a shared machine): the anchors'
   first 64 `main` prompts admitted together and prefilled, then 16 decode steps of the 64-sequence
   batch timed; the three ways alternate `--rounds` times, so a change of load on the machine falls on
   all three alike. Median step time and its tok/s (64 tokens a step).
2. The workload (`--skip-workload` leaves it out): the anchors' `main` (64 requests, prompts around 100
   tokens, 32-256 output tokens, greedy, ignore_eos; bench/harness/workload.py), or its first
   --requests, submitted at once, output tok/s of the whole batch; the three ways alternate
   `--repeats` times, the prefix cache reset before each.

Each LoRA way's ratio to `base` is printed (the goal: within 15%, ratio >= 0.85). With
`--torch-path`, a fourth way, `4 adapters, torch ops`, runs the 4 adapters on the products the engine
falls back to where the compiled CPU kernel cannot be built (kernels/lora.py: lora_add_segmented), in
the same rounds: the kernel's before and after. `--products` times only the products of a decode
step (SmolLM2-135M's 120 adapted modules, 64 rows of 4 adapters), kernel against torch ops, and exits.

With `--vllm-python` (a venv with vLLM's CPU build) and `--anchors` (the folder of its bench_vllm.py),
vLLM then runs the same `main` workload on the same checkpoint and dtype, tuned as in bench.vs_vllm,
twice: as configured for the base model, and with `enable_lora` serving the same 4 adapter folders
(request i under adapter i mod 4; vLLM's CPU LoRA is PunicaWrapperCPU's torch ops), each the median of
--repeats; streamer's and vLLM's `4 adapters` tok/s and each one's ratio to its own base are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import streamer_kernels.lora as lora_kernels
import torch

from bench.harness.vllm import VLLM_FLAGS, VLLM_LORA
from bench.harness.workload import ANCHOR_WORKLOADS, fingerprint
from streamer import LLM, SamplingParams
from streamer.lora import LoRARequest
from workers.default_model import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 4
DECODE_BATCH = 64
DECODE_STEPS = 16


def build_adapters(model: Path, out: Path, rank: int) -> list[LoRARequest]:
    """Random PEFT adapters (PEFT's default init leaves B at zero; random weights keep the outputs
    honest about being adapted, and the products cost the same either way)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    loras = []
    for i in range(NUM_ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                     init_lora_weights=False))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
        peft_model.save_pretrained(str(out / f"adapter{i}"))
        loras.append(LoRARequest(f"adapter{i}", str(out / f"adapter{i}")))
    return loras


@contextlib.contextmanager
def products_as_torch_ops(on: bool) -> Iterator[None]:
    """The engine's CPU LoRA products as torch ops (its path without compiled kernels) while on."""
    kernels = lora_kernels.cpu_kernels
    if on:
        lora_kernels.cpu_kernels = lambda: None
    try:
        yield
    finally:
        lora_kernels.cpu_kernels = kernels


# SmolLM2-135M's adapted modules: (in, output widths of the parts) of q/k/v, o, gate/up, down; 30 layers.
PRODUCT_MODULES = [(576, [576, 192, 192]), (576, [576]), (576, [1536, 1536]), (1536, [576])]
PRODUCT_LAYERS = 30


def products_ms(dtype: torch.dtype, rank: int, rounds: int) -> dict[str, float]:
    """The LoRA products alone, a decode step's worth (every adapted module of 30 layers, 64 rows, 4
    rank-`rank` slots on every part), on the compiled kernel and on the torch ops: the fastest of
    `rounds` (the least disturbed on a shared machine), in ms."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for n_in, sizes in PRODUCT_MODULES:
        cols = [0, *itertools.accumulate(sizes)]
        k = len(sizes) * rank
        a_t = torch.randn(NUM_ADAPTERS, n_in, k, generator=gen) * 0.01
        b_t = torch.zeros(NUM_ADAPTERS, k, cols[-1])
        spans = torch.tensor([[[p * rank, (p + 1) * rank] for p in range(len(sizes))]] * NUM_ADAPTERS)
        for p in range(len(sizes)):
            b_t[:, p * rank:(p + 1) * rank, cols[p]:cols[p + 1]] = torch.randn(NUM_ADAPTERS, rank, sizes[p]) * 0.01
        x = torch.randn(DECODE_BATCH, n_in, generator=gen).to(dtype)
        calls.append((x, torch.randn(DECODE_BATCH, cols[-1]).to(dtype), a_t, b_t, spans, torch.tensor(cols)))
    seg = lora_kernels.Segments.from_slots(torch.arange(DECODE_BATCH, dtype=torch.int32) * NUM_ADAPTERS // DECODE_BATCH)
    out = {}
    for name, torch_ops in (("kernel", False), ("torch ops", True)):
        with products_as_torch_ops(torch_ops):
            times = []
            for _ in range(rounds + 1):  # the first untimed
                t0 = time.perf_counter()
                for _ in range(PRODUCT_LAYERS):
                    for x, y, a_t, b_t, spans, cols in calls:
                        lora_kernels.lora_add_cpu(x, y, a_t, b_t, seg, spans, cols)
                times.append(time.perf_counter() - t0)
        out[name] = min(times[1:]) * 1000
    return out


def decode_step_s(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], tag: str) -> float:
    """Median time of a decode step of the whole batch (prefilled first, aborted after)."""
    engine = llm.engine
    engine.scheduler.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=DECODE_STEPS + 8, temperature=0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, prompt, params, lora_request=loras[i % len(loras)])
    sched = engine.scheduler
    while len(sched.waiting) or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        engine.step()
    engine.step()  # the first step with every sequence decoding
    times = []
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return statistics.median(times)


def workload_tps(llm: LLM, reqs: list[dict], loras: list[LoRARequest | None]) -> float:
    """Output tok/s of the whole batch submitted at once (every request's length checked)."""
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in reqs]
    per_request = [loras[i % len(loras)] for i in range(len(reqs))]
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in reqs], params, lora_request=per_request)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r["max_tokens"] for r in reqs), "a request ended early"
    return tokens / elapsed


def vllm_tps(args: argparse.Namespace, model: Path, reqs: list[dict], loras: list[LoRARequest]) -> float:
    """vLLM's median output tok/s on `main` (with `loras`, request i under adapter i mod len)."""
    script = str(Path(args.anchors) / "bench_vllm.py")
    program = ["-c", VLLM_LORA, script] if loras else [script]
    cmd = [args.vllm_python, *program, str(model), "--dtype", args.dtype, "--repeats", str(args.repeats),
           "--workload", "main", *VLLM_FLAGS["main"]]
    env = {**os.environ, "STREAMER_BENCH_LORAS": json.dumps([[a.name, a.path] for a in loras]),
           "STREAMER_BENCH_LORA_RANK": str(args.rank)}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    if result["fingerprint"] != fingerprint(reqs):
        raise RuntimeError(f"workload differs: vLLM ran {result['fingerprint']}, streamer {fingerprint(reqs)}")
    return result["median_output_tok_s"]


def report(title: str, results: dict[str, list[float]], unit: str, to_tps: float = 0.0) -> None:
    base = statistics.median(results["base"])
    print(f"\n{title}")
    print(f"{'run':>22} | {unit:>12} | {'tok/s':>8} | vs base | all")
    for name, values in results.items():
        median = statistics.median(values)
        tps = to_tps / median if to_tps else median
        ratio = base / median if to_tps else median / base
        shown = ", ".join(f"{v * 1000:.1f}" if to_tps else f"{v:.1f}" for v in values)
        print(f"{name:>22} | {median * 1000 if to_tps else median:12.1f} | {tps:8.1f} | {ratio:7.3f} | {shown}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint folder (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="decode measure: alternations of the three ways")
    ap.add_argument("--repeats", type=int, default=1, help="workload measure: alternations of the three ways")
    ap.add_argument("--workload", default="main", choices=sorted(ANCHOR_WORKLOADS))
    ap.add_argument("--requests", type=int, default=0, help="run the workload's first N requests (0: all)")
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--torch-path", action="store_true",
                    help="decode measure: also the 4 adapters on torch ops (the path without the compiled kernel)")
    ap.add_argument("--products", action="store_true",
                    help="only the products of a decode step, kernel against torch ops, on SmolLM2-135M's shapes")
    ap.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build (main workload, all requests)")
    ap.add_argument("--anchors", help="the folder holding bench_vllm.py")
    args = ap.parse_args()
    if args.vllm_python and (not args.anchors or args.skip_workload or args.requests or args.workload != "main"):
        ap.error("--vllm-python needs --anchors and the whole main workload")
    if args.products:
        ms = products_ms(getattr(torch, args.dtype), args.rank, 3 * args.rounds)
        print(f"LoRA products of a decode step ({DECODE_BATCH} rows, {NUM_ADAPTERS} adapters, rank {args.rank}, "
              f"{args.dtype}, {PRODUCT_LAYERS} layers x {len(PRODUCT_MODULES)} modules): "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
        return
    model = resolve_model(args.model or None)
    reqs = ANCHOR_WORKLOADS[args.workload]()
    reqs = reqs[:args.requests] if args.requests else reqs
    decode_prompts = [r["prompt"] for r in ANCHOR_WORKLOADS["main"]()[:DECODE_BATCH]]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = build_adapters(model, Path(tmp), args.rank)
        llm = LLM(str(model), dtype=args.dtype, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank)
        ways = {"base": [None], f"{NUM_ADAPTERS} adapters": list(adapters),
                f"{NUM_ADAPTERS} adapters + base": [*adapters, None]}
        decode_ways = dict(ways)
        torch_ops = f"{NUM_ADAPTERS} adapters, torch ops"
        if args.torch_path:
            decode_ways[torch_ops] = list(adapters)
        # Warm-up: every adapter read and in its slot, the batch shapes' first-call costs paid, untimed.
        for name, loras in decode_ways.items():
            with products_as_torch_ops(name == torch_ops):
                decode_step_s(llm, decode_prompts, loras, f"warm-{name}")
        steps: dict[str, list[float]] = {name: [] for name in decode_ways}
        for r in range(args.rounds):
            for name, loras in decode_ways.items():
                with products_as_torch_ops(name == torch_ops):
                    steps[name].append(decode_step_s(llm, decode_prompts, loras, f"{r}-{name}"))
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1] * 1000:.1f} ms" for n, v in steps.items()), flush=True)
        report(f"decode steps of {DECODE_BATCH} sequences, {model.name}, {args.dtype}, rank {args.rank}, "
               f"medians of {args.rounds} rounds x {DECODE_STEPS} steps:", steps, "step ms", DECODE_BATCH)
        if args.skip_workload:
            return
        tps: dict[str, list[float]] = {name: [] for name in ways}
        for repeat in range(args.repeats):
            for name, loras in ways.items():
                tps[name].append(workload_tps(llm, reqs, loras))
                print(f"repeat {repeat + 1} {name}: {tps[name][-1]:.1f} tok/s", flush=True)
        report(f"{args.workload} ({len(reqs)} requests, {sum(r['max_tokens'] for r in reqs)} output tokens), "
               f"medians of {args.repeats}:", tps, "tok/s")
        if args.vllm_python:
            del llm  # its memory back before vLLM's engine starts
            theirs = {"base": vllm_tps(args, model, reqs, []), "4 adapters": vllm_tps(args, model, reqs, adapters)}
            ours = statistics.median(tps[f"{NUM_ADAPTERS} adapters"])
            print(f"\nvLLM ({args.dtype}, medians of {args.repeats}): base {theirs['base']:.1f} tok/s, "
                  f"{NUM_ADAPTERS} adapters {theirs['4 adapters']:.1f} tok/s "
                  f"({theirs['4 adapters'] / theirs['base']:.3f} of its base); streamer {NUM_ADAPTERS} adapters "
                  f"{ours:.1f} tok/s = {ours / theirs['4 adapters']:.2f}x vLLM's")


if __name__ == "__main__":
    main()
