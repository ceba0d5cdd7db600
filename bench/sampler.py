"""What sampling costs against a greedy step, batch 64, 32k vocabulary.

    python -m bench.sampler --model DIR [--dtype float32|bfloat16] [--batch 64] [--steps 24]

Two measurements in one run:
1. Engine decode steps: `--batch` requests decode together, greedy and then sampled with each
   rule set below, alternating; the median step time of each and the sampled/greedy ratio.
2. The sampler alone on `[batch, vocab]` logits of the model's dtype, per rule set: ms per call
   and that time as a share of the greedy decode step measured in 1.
Rule sets: greedy; the anchor sampled workload (temperature 0.8, top-p 0.95, top-k 50);
OpenAI's defaults (temperature 1); top-p 0.9 alone; min-p 0.05; the anchor set with seeds;
the anchor set with presence/frequency/repetition penalties; the anchor set with logprobs 5.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from streamer.request import Sequence
from streamer.sampler import Sampler

ANCHOR = SamplingParams(temperature=0.8, top_p=0.95, top_k=50)
RULES = {
    "greedy": SamplingParams(temperature=0.0),
    "anchor (T 0.8, top-p 0.95, top-k 50)": ANCHOR,
    "temperature 1 (OpenAI default)": SamplingParams(),
    "top-p 0.9 alone": SamplingParams(top_p=0.9),
    "min-p 0.05": SamplingParams(min_p=0.05),
    "anchor + seed": replace(ANCHOR, seed=7),
    "anchor + penalties": replace(ANCHOR, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
    "anchor + logprobs 5": replace(ANCHOR, logprobs=5),
}


def decode_step_ms(engine: LLMEngine, params: SamplingParams, batch: int, steps: int, rng: random.Random) -> float:
    """Median time of the steps where all `batch` requests decode (after their prompts)."""
    vocab = engine.model_config.hf_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(4, vocab) for _ in range(32)]
        engine.add_request(f"r{rng.random()}-{i}", prompt,
                           replace(params, max_tokens=steps + 4, ignore_eos=True, min_tokens=0))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outs) == batch:
            times.append(elapsed)
    return 1e3 * statistics.median(times[1:])  # the first also computed the prompts


def sampler_ms(params: SamplingParams, batch: int, vocab: int, dtype: torch.dtype, repeats: int = 30) -> float:
    gen = torch.Generator().manual_seed(0)
    # A trained model's logits are peaked: a scaled Gaussian gives a nucleus of tens of tokens.
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype)
    history = torch.randint(4, vocab, (batch, 160), generator=gen).tolist()
    seqs = [Sequence(request_id=str(i), index=0, token_ids=h, num_prompt_tokens=100, params=params)
            for i, h in enumerate(history)]
    sampler = Sampler({2}, seed=0)
    for _ in range(3):
        sampler(logits, seqs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, seqs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, seed=0))
    rng = random.Random(0)
    decode_step_ms(engine, RULES["greedy"], 8, 4, rng)  # warm-up
    steps = {name: [] for name in ("greedy", "anchor (T 0.8, top-p 0.95, top-k 50)", "temperature 1 (OpenAI default)")}
    for _ in range(3):  # alternate, so drift hits both alike
        for name in steps:
            steps[name].append(decode_step_ms(engine, RULES[name], args.batch, args.steps, rng))
    step = {name: statistics.median(v) for name, v in steps.items()}
    greedy_ms = step["greedy"]
    vocab = engine.model_config.hf_config.vocab_size
    dtype = getattr(torch, args.dtype)
    print(f"decode step, batch {args.batch}, {args.dtype}, vocab {vocab}:")
    for name, ms in step.items():
        print(f"  {name:<40} {ms:7.2f} ms  {ms / greedy_ms:5.3f}x greedy")
    print(f"sampler alone on [{args.batch}, {vocab}] {args.dtype} logits (share of the greedy step):")
    micro = {}
    for name, params in RULES.items():
        micro[name] = sampler_ms(params, args.batch, vocab, dtype)
        extra = micro[name] - micro["greedy"]
        print(f"  {name:<40} {micro[name]:7.2f} ms  {100 * micro[name] / greedy_ms:5.1f}%  "
              f"(+{100 * extra / greedy_ms:4.1f}% over greedy sampling)")
    if args.json:
        Path(args.json).write_text(json.dumps({"step_ms": step, "sampler_ms": micro, "batch": args.batch,
                                               "dtype": args.dtype, "vocab": vocab}, indent=1))


if __name__ == "__main__":
    main()
