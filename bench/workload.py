"""The synthetic offline workload shared by the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab_size: int, mean_prompt: int = 100, min_out: int = 32,
                  max_out: int = 256, seed: int = 0) -> Workload:
    """Prompts ~lognormal around `mean_prompt` tokens, outputs uniform in [min_out, max_out]."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = max(4, min(4 * mean_prompt, int(rng.lognormvariate(0, 0.5) * mean_prompt)))
        prompts.append([rng.randrange(8, vocab_size) for _ in range(n)])
        outs.append(rng.randint(min_out, max_out))
    return Workload(prompts, outs)


def bench_checkpoint(cache_dir: Path) -> Path:
    """The ~110M-parameter random Llama (32k vocab), built once and cached."""
    from streamer.random_checkpoint import bench_spec, build_checkpoint

    path = cache_dir / "llama-110m-random"
    if not (path / "model.safetensors").exists():
        build_checkpoint(path, bench_spec(), seed=0)
    return path


def warm_up(engine: object, prompt: list[int]) -> None:
    """One short untimed request: allocator, first-call and kernel-build costs stay out of timings."""
    from streamer import SamplingParams

    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()


def submit_greedy(engine: object, work: Workload) -> None:
    """Queue the whole workload at once: greedy, ignore_eos, each request its output length."""
    from streamer import SamplingParams

    for i, (p, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(str(i), {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
