"""Multi-LoRA throughput: a batch mixing 4 adapters against the base model alone, in the same run.

    python -m bench.lora [--model DIR] [--dtype bfloat16] [--rank 16] [--repeats 2] [--workload main]

The anchors' `main` workload (64 requests, prompts around 100 tokens, 32-256 output tokens each,
greedy, ignore_eos: bench/harness/workload.py) runs on the built-in SmolLM2-135M-Instruct (or --model)
three ways, alternating, `--repeats` times, the prefix cache reset before each: every request on the
base model; every request under one of 4 adapters (request i under adapter i mod 4); and base and the
4 adapters mixed (i mod 5). The adapters are random PEFT adapters of rank --rank on all seven
projections (q, k, v, o, gate, up, down), built here with `peft` (installed with the test extras).
Prints output tok/s (median of the repeats) and each LoRA run's ratio to the base run (the goal: within
15%, ratio >= 0.85).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness.machine import wait_quiet
from bench.harness.workload import ANCHOR_WORKLOADS
from streamer import LLM, SamplingParams
from streamer.lora import LoRARequest
from workers.default_model import resolve_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 4


def build_adapters(model: Path, out: Path, rank: int) -> list[LoRARequest]:
    """Random PEFT adapters (B is zero at PEFT's default init: a real adapter's B is not, and the
    product runs either way, but random weights keep the outputs honest about being adapted)."""
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


def run_once(llm: LLM, reqs: list[dict], loras: list[LoRARequest | None]) -> tuple[float, int]:
    """Output tok/s of the whole batch submitted at once, and the output tokens (checked)."""
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in reqs]
    per_request = [loras[i % len(loras)] for i in range(len(reqs))]
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in reqs], params, lora_request=per_request)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r["max_tokens"] for r in reqs), "a request ended early"
    return tokens / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint folder (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workload", default="main", choices=sorted(ANCHOR_WORKLOADS))
    ap.add_argument("--no-wait", action="store_true", help="do not wait for an idle CPU before each run")
    args = ap.parse_args()
    model = resolve_model(args.model or None)
    reqs = ANCHOR_WORKLOADS[args.workload]()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = build_adapters(model, Path(tmp), args.rank)
        llm = LLM(str(model), dtype=args.dtype, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank)
        # Warm-up: every adapter read and put in its slot, first-call costs paid, outside the timings.
        llm.generate([[1, 2, 3, 4]] * (NUM_ADAPTERS + 1), SamplingParams(max_tokens=4, ignore_eos=True),
                     lora_request=[*adapters, None])
        runs = {"base": [None], f"{NUM_ADAPTERS} adapters": list(adapters),
                f"{NUM_ADAPTERS} adapters + base": [*adapters, None]}
        results: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(args.repeats):
            for name, loras in runs.items():
                idle = None if args.no_wait else wait_quiet(timeout=30)
                tps, tokens = run_once(llm, reqs, loras)
                results[name].append(tps)
                print(f"repeat {repeat + 1} {name:>20}: {tps:8.1f} tok/s ({tokens} tokens"
                      + (f", CPU idle {idle:.0%} before" if idle is not None else "") + ")", flush=True)
    base = statistics.median(results["base"])
    print(f"\n{args.workload}, {model.name}, {args.dtype}, rank {args.rank}, medians of {args.repeats}:")
    print(f"{'run':>22} | {'tok/s':>8} | vs base")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:>22} | {median:8.1f} | {median / base:.3f}")


if __name__ == "__main__":
    main()
