"""The synthetic offline workload shared by the benchmarks."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
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
    from workers.progress_display import task

    path = cache_dir / "llama-110m-random"
    if not (path / "model.safetensors").exists():
        # (transformers' own "Writing model shards" bar would cut into ours: dropped)
        with task(f"building the random 110M checkpoint in {path} (first run only)"), \
                contextlib.redirect_stderr(io.StringIO()):
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


# ---- the speed-anchor workloads, reproduced exactly (same RNG calls, same fingerprints) -------
ANCHOR_VOCAB, ANCHOR_FIRST_ID = 32000, 4  # ids 0..3 are the specials of the anchor tokenizer


def _anchor_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(ANCHOR_FIRST_ID, ANCHOR_VOCAB) for _ in range(n)]


def anchor_main(seed: int = 0) -> list[dict]:
    """64 requests, prompts ~lognormal(ln 100, 0.8) clipped to [16, 512], 32-256 output tokens."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(64):
        plen = max(16, min(512, int(round(rng.lognormvariate(math.log(100), 0.8)))))
        olen = rng.randint(32, 256)
        reqs.append({"prompt": _anchor_ids(rng, plen), "max_tokens": olen})
    return reqs


def anchor_chat(seed: int = 0) -> list[dict]:
    """32 requests sharing a 200-token prefix, each with an 8-32-token suffix, 64 output tokens."""
    rng = random.Random(seed + 1_000_003)
    prefix = _anchor_ids(rng, 200)
    return [{"prompt": prefix + _anchor_ids(rng, rng.randint(8, 32)), "max_tokens": 64} for _ in range(32)]


def prefill_heavy(seed: int = 0) -> list[dict]:
    """Prompt processing: 16 distinct prompts of 1,000-1,900 tokens, 8 output tokens each, so
    nearly all of the time is prefill (chunked at the token budget, next to the few decodes)."""
    rng = random.Random(seed + 2_000_003)
    return [{"prompt": _anchor_ids(rng, rng.randint(1000, 1900)), "max_tokens": 8} for _ in range(16)]


ANCHOR_WORKLOADS = {"main": anchor_main, "chat": anchor_chat, "prefill": prefill_heavy}


def fingerprint(reqs: list[dict]) -> str:
    """The anchors' fingerprint: equal strings mean both engines ran identical inputs."""
    return hashlib.sha256(json.dumps(reqs, separators=(",", ":")).encode()).hexdigest()[:12]
