"""The routing simulation's token ids and step-time model: how long a simulated worker's step takes,
fitted to real engine steps on this machine (bench/routing_sim.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.machine import CACHE_DIR
from streamer.sampling_params import SamplingParams

MIN_MATCH_TOKENS = 64  # choose(min_match_tokens=...)'s default
IM_START, IM_END, NEWLINE = 3, 4, 10  # template tokens; words are ids from FIRST_WORD_ID up
ROLE_IDS = {"system": 5, "user": 6, "assistant": 7}
FIRST_WORD_ID = 16


# --- the step-time model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepModel:
    a: float  # seconds per step
    b: float  # seconds per scheduled token

    def seconds(self, tokens: int) -> float:
        return self.a + self.b * tokens


def fit(points: list[tuple[int, float]]) -> StepModel:
    """Least squares of seconds = a + b * tokens."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return StepModel(max(0.0, my - b * mx), b)


def engine_steps(engine: Any, batch: int, prompt: int, out: int, rng: random.Random) -> list[Any]:
    """Run `batch` requests of `prompt` random tokens to `out` tokens; the engine's step records."""
    for i in range(batch):
        ids = [rng.randrange(FIRST_WORD_ID, 500) for _ in range(prompt)]
        engine.add_request(f"m{rng.random()}-{i}", ids, SamplingParams(max_tokens=out, temperature=0.0,
                                                                       ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.take_step_records()


def step_checkpoint(which: str, tmp: Path) -> Path:
    """`tiny`: bench/routing.py's random Llama; `110m`: bench/throughput.py's (a model whose steps
    take ~50x longer on this CPU, as a large model's do on a GPU), built once into ~/.cache."""
    if which == "110m":
        from bench.harness.workload import bench_checkpoint

        return bench_checkpoint(CACHE_DIR)
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    return build_checkpoint(tmp / "tiny", TinyModelSpec(arch="llama", max_position_embeddings=4096), seed=1)


def typical(seconds: list[float]) -> float:
    """The lower fifth of a sample: this machine is shared, and the steps another job slowed down
    are not what the engine costs."""
    return sorted(seconds)[len(seconds) // 5]


def measure_step_model(ckpt: Path) -> tuple[StepModel, list[tuple[str, int, float]]]:
    """Step time of decode batches and of whole prompts of several sizes, on the engine."""
    from streamer import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=1024, max_num_seqs=16,
                                    enable_prefix_caching=False, device="cpu"))
    rng = random.Random(0)
    engine_steps(engine, 2, 64, 8, rng)  # warm-up: first steps pay for lazy initialisation
    rows = []
    for batch in (1, 4, 8, 16):  # decodes: `batch` tokens a step
        decodes = [r.total_s for r in engine_steps(engine, batch, 16, 24, rng) if not r.num_prefill_tokens]
        rows.append(("decode", batch, typical(decodes)))
    for prompt in (256, 512, 1024, 1536):  # one prompt in one step (the longest prompts here are ~1,400)
        prefills = [r.total_s for _ in range(5) for r in engine_steps(engine, 1, prompt, 1, rng)
                    if r.num_prefill_tokens]
        rows.append(("prompt", prompt, typical(prefills)))
    engine.shutdown()
    return fit([(tokens, s) for _, tokens, s in rows]), rows
