"""Cost of constrained decoding: grammar mask time against step time at batch 1, 16 and 64, and what
unconstrained requests sharing the batch pay, in one run.

    python -m bench.structured_outputs [--steps 24] [--repeats 3] [--cache-dir DIR]

On the 110M random Llama (32k vocab, fp32): for each batch size, the same greedy decode steps run
(1) unconstrained, (2) every request constrained by a large nested JSON schema, (3) half and half.
Reported per step: the mean step time of each, the time the step spends on grammar masks (timed
around streamer.grammar.apply_masks, and around the wait for the mask thread's fills before each
schedule, MaskFiller.settle: the fills themselves run beside the step), mask time as a share of the
step, and the unconstrained requests' step time in the mixed batch against the all-unconstrained one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import streamer.sampler as sampler_module
from bench.harness.machine import CACHE_DIR
from bench.harness.workload import bench_checkpoint
from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from workers.progress_display import task

ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "price", "tags"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                       "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}}}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["id", "customer", "items", "shipping", "status"],
          "properties": {
              "id": {"type": "string"}, "status": {"enum": ["new", "paid", "shipped", "done", "cancelled"]},
              "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "address"],
                           "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                          "vip": {"type": "boolean"},
                                          "address": {"type": "object", "additionalProperties": False,
                                                      "required": ["street", "city", "country"],
                                                      "properties": {k: {"type": "string"} for k in (
                                                          "street", "city", "zip", "country", "region")}}}},
              "items": {"type": "array", "minItems": 1, "items": ITEM},
              "shipping": {"type": "object", "additionalProperties": False, "required": ["method", "cost"],
                           "properties": {"method": {"enum": ["post", "courier", "pickup"]},
                                          "cost": {"type": "number"}, "insured": {"type": "boolean"}}}}}


class MaskTimer:
    """Wraps a function (the sampler's apply_masks, the engine's wait for fills) to add up its time."""

    def __init__(self, inner: Any, total: MaskTimer | None = None) -> None:
        self.seconds = 0.0
        self.inner, self.total = inner, total

    def __call__(self, *args: object) -> None:
        start = time.perf_counter()
        self.inner(*args)
        spent = time.perf_counter() - start
        for timer in (self, self.total):
            if timer is not None:
                timer.seconds += spent


def run(engine: LLMEngine, batch: int, constrained: int, steps: int, timer: MaskTimer) -> tuple[float, float]:
    """(mean decode step seconds, mask seconds per step) for `batch` requests, `constrained` of them
    under SCHEMA, all greedy (ignore_eos, so none ends early), after their prompts are in."""
    for i in range(batch):
        spec = {"json": SCHEMA} if i < constrained else None
        engine.add_request(f"b{batch}-c{constrained}-{i}", {"prompt_token_ids": [11 + i, 12, 13, 14]},
                           SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True,
                                          structured_outputs=spec))
    engine.step()  # the prompts (and the first sampled tokens)
    timer.seconds, times = 0.0, []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    mask = timer.seconds / steps
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case (the median is reported)")
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=str(bench_checkpoint(args.cache_dir)), dtype="float32"))
    timer = MaskTimer(sampler_module.apply_masks)
    sampler_module.apply_masks = timer  # the sampler looks the name up at call time
    start = time.perf_counter()
    engine.grammars().compile({"json": SCHEMA})
    compile_s = time.perf_counter() - start
    masks = engine.grammars().masks
    masks.settle = MaskTimer(masks.settle, timer)  # type: ignore[method-assign]
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    for b in batches:  # warm-up: the first steps of each shape pay for oneDNN's kernel choice
        run(engine, b, b // 2, 4, timer)

    def median_of(b: int, constrained: int) -> tuple[float, float]:
        runs = [run(engine, b, constrained, args.steps, timer) for _ in range(args.repeats)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    with task("batches", total=len(batches)) as bar:
        for b in batches:
            free, _ = median_of(b, 0)
            full, mask_full = median_of(b, b)
            mixed, mask_mixed = median_of(b, b // 2) if b > 1 else (free, 0.0)
            rows.append({"batch": b, "step_ms_unconstrained": round(free * 1e3, 2),
                         "step_ms_constrained": round(full * 1e3, 2), "mask_ms": round(mask_full * 1e3, 3),
                         "mask_share_pct": round(100 * mask_full / full, 2),
                         "step_ms_mixed_half": round(mixed * 1e3, 2), "mask_ms_mixed": round(mask_mixed * 1e3, 3),
                         "unconstrained_cost_in_mixed_pct": round(100 * (mixed - mask_mixed - free) / free, 2)})
            bar.advance()
    print(json.dumps({"schema_compile_ms": round(compile_s * 1e3, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
