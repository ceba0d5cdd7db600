"""Quantized weights and the fp8 KV cache on the built-in model: accuracy, speed, capacity.

    python -m bench.quantization [--model DIR] [--batches 1,2,4,8] [--repeats 3] [--tokens 64]
                                 [--accuracy-tokens 1000] [--skip-speed] [--skip-accuracy] [--kernels]
                                 [--configs fp32,bf16,int8,fp8kv,int8+fp8kv] [--threads N]

Accuracy (against the same model in bfloat16): the bf16 engine writes `--accuracy-tokens` greedy
tokens over 4 prompts; every other configuration then reads that exact text back (teacher
forcing: each sequence as one prompt, its logits at every position taken from the prefill) and we
report, per generated token, |log p(token) - log p_bf16(token)| (mean, 99th percentile, max) and how
often its own argmax is the bf16 run's token; then each runs free (greedy, its own tokens) and we
report how many tokens equal bf16's before the first difference and in all.

Speed: decode tokens/s at batch sizes `--batches` (B prompts of ~30 tokens, `--tokens` new each,
ignore_eos), the prefill step excluded, every configuration built once and run in turn, best of
`--repeats`. Capacity: KV blocks in 1 GiB and the sequences of 1,024 tokens they hold.

`--kernels` (alone): the int8 GEMM options on the built-in model's layer shapes, microseconds per
call (best of 30): oneDNN bfloat16 with packed weights (what bf16 runs), torch._weight_int8pack_mm,
and streamer's kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from workers.default_model import resolve_model

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "bf16 + fp8 KV": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"},
    "bf16 + fp8 KV (calibrated)": {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "int8 + fp8 KV": {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "fp8"},
    "fp8 weights (CPU reference)": {"dtype": "bfloat16", "quantization": "fp8"},
}
SPEED_CONFIGS = ("fp32", "bf16", "int8", "bf16 + fp8 KV", "int8 + fp8 KV")
SPEED_CONFIG_NAMES = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "fp8kv": "bf16 + fp8 KV",
                      "int8+fp8kv": "int8 + fp8 KV"}
# Free-running greedy decodes (slow on a busy 2-core machine): the configurations served fast on the CPU
FREE_RUN_CONFIGS = ("int8", "bf16 + fp8 KV", "int8 + fp8 KV")
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and when its operations are slow.",
    "List the steps to bake bread at home, with the reasons for each step.",
    "Describe the water cycle to a ten-year-old, then to a geology student.",
]


def engine(model: str, name: str, **extra: Any) -> LLMEngine:
    # No prefix caching: a teacher-forced sequence is text the same engine just wrote, and a cache hit
    # would leave its positions out of the prefill whose logits are read.
    return LLMEngine(EngineConfig(model=model, device="cpu", seed=0, max_num_batched_tokens=4096,
                                  enable_prefix_caching=False, **CONFIGS[name], **extra))


def chat_ids(model: str, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": ids}, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id] += o.outputs[0].token_ids
    return [out[str(i)] for i in range(len(prompts))]


def teacher_forced_logprobs(eng: LLMEngine, prompt: list[int], text: list[int]) -> torch.Tensor:
    """log-softmax rows predicting each token of `text` after `prompt`, from one prefill of both."""
    runner, captured = eng.executor, []
    original = runner.run

    def capture(inputs: Any) -> torch.Tensor | None:
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            captured.append(torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1))
        return captured[-1][inputs.sample_rows].to(hidden.dtype) if inputs.sample_rows.numel() else None

    runner.run = capture
    try:
        run(eng, [prompt + text], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        runner.run = original
    rows = torch.cat(captured)
    return rows[len(prompt) - 1:len(prompt) + len(text) - 1]


@dataclass
class Accuracy:
    mean_abs: float
    p99_abs: float
    max_abs: float
    forced_agree: float
    free_prefix: list[int]
    free_equal: int
    tokens: int


def accuracy(model: str, total: int) -> dict[str, Accuracy]:
    prompts = chat_ids(model, PROMPTS)
    per = total // len(prompts)
    greedy = SamplingParams(max_tokens=per, temperature=0.0, ignore_eos=True)
    ref_engine = engine(model, "bf16")
    reference = run(ref_engine, prompts, greedy)
    ref_rows = [teacher_forced_logprobs(ref_engine, p, t) for p, t in zip(prompts, reference)]
    del ref_engine
    results = {}
    for name in CONFIGS:
        if name == "bf16":
            continue
        eng = engine(model, name)
        diffs, agree = [], 0
        for p, t, ref in zip(prompts, reference, ref_rows):
            rows = teacher_forced_logprobs(eng, p, t)
            idx = torch.tensor(t)[:, None]
            diffs.append((rows.gather(1, idx) - ref.gather(1, idx)).abs().flatten())
            agree += int((rows.argmax(1) == idx.flatten()).sum())
        free = run(eng, prompts, greedy) if name in FREE_RUN_CONFIGS else []
        prefix = [next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(r)) for f, r in zip(free, reference)]
        d = torch.cat(diffs)
        results[name] = Accuracy(float(d.mean()), float(d.quantile(0.99)), float(d.max()), agree / d.numel(), prefix,
                                 sum(a == b for f, r in zip(free, reference) for a, b in zip(f, r)), d.numel())
        free_text = (f"free greedy: first difference at {prefix}, {results[name].free_equal}/{d.numel()} equal"
                     if free else "free greedy: not run")
        print(f"{name:30s} |dlogp| mean {d.mean():.4f} p99 {d.quantile(0.99):.4f} max {d.max():.4f}  "
              f"forced argmax agreement {agree / d.numel():.1%}  {free_text}", flush=True)
        del eng
    return results


def decode_rate(eng: LLMEngine, batch: int, tokens: int) -> float:
    prompts = [[1 + (7 * b + 3 * i) % 4000 for i in range(30)] for b in range(batch)]
    for b, ids in enumerate(prompts):
        eng.add_request(f"s{b}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                          ignore_eos=True))
    eng.step()  # the prefills (and each sequence's first token)
    start, made = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        made += sum(len(o.outputs[0].token_ids) for o in eng.step())
    return made / (time.perf_counter() - start)


def speed(model: str, batches: list[int], tokens: int, repeats: int, configs: tuple[str, ...] = SPEED_CONFIGS
          ) -> dict[str, dict[int, float]]:
    engines = {name: engine(model, name, kv_cache_memory_gb=0.25) for name in configs}
    best: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in engines}
    for _ in range(repeats):
        for b in batches:
            for name, eng in engines.items():  # in turn, so a busy spell on the machine hits them alike
                best[name][b].append(decode_rate(eng, b, tokens))
                print(f"  {name} batch {b}: {best[name][b][-1]:.1f} tok/s", flush=True)
    rates = {n: {b: max(v) for b, v in per.items()} for n, per in best.items()}
    print(f"\ndecode tok/s (best of {repeats}; median in brackets)")
    print("config".ljust(16) + "".join(f"batch {b}".rjust(22) for b in batches))
    for name in engines:
        cells = "".join(f"{rates[name][b]:9.1f} ({statistics.median(best[name][b]):6.1f}) "
                        f"{rates[name][b] / rates['bf16'][b]:4.2f}x".rjust(22) for b in batches)
        print(name.ljust(16) + cells)
    return rates


def capacity(model: str) -> None:
    print("\nKV capacity in 1 GiB (block_size 16):")
    for name in ("bf16", "bf16 + fp8 KV"):
        eng = engine(model, name, kv_cache_memory_gb=1.0, max_num_seqs=100000)
        blocks = eng.executor.num_kv_blocks
        print(f"  {name:16s} {blocks} blocks = {blocks * 16} tokens = {blocks * 16 // 1024} sequences of 1,024 tokens")
        del eng


def kernels() -> None:
    from streamer_kernels.int8_gemm import pack_int8_weight, quantize_int8_ref
    from streamer_kernels.int8_gemm_cpu import int8_linear_cpu

    def best_us(fn: Any, n: int = 30) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e6

    print("out x in, rows: oneDNN bf16 | _weight_int8pack_mm (bf16 x) | streamer int8 (us)")
    for n, k in ((1728, 576), (3072, 576), (576, 1536), (49152, 576)):  # qkv, gate_up, down, LM head
        w = torch.randn(n, k)
        q, scale = quantize_int8_ref(w)
        packed, onednn = pack_int8_weight(q), torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 8)
        for m in (1, 4, 8, 16, 64):
            x = torch.randn(m, k).bfloat16()
            a = best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))  # noqa: B023
            b = best_us(lambda: torch._weight_int8pack_mm(x, q, scale.bfloat16()))  # noqa: B023
            c = best_us(lambda: int8_linear_cpu(x, packed, scale, None, n))  # noqa: B023
            print(f"{n:6d} x {k:4d}, {m:2d}: {a:8.0f} | {b:8.0f} | {c:8.0f}   int8 {a / c:4.2f}x of bf16", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--accuracy-tokens", type=int, default=1000)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default). On a machine shared with other busy work, 1: "
                             "with 2 threads every parallel region's barrier waits for a descheduled thread, "
                             "and a 135M model's decode step measured 1.3-5.8 s instead of ~0.1")
    parser.add_argument("--configs", default=",".join(SPEED_CONFIG_NAMES),
                        help="speed: which of " + ", ".join(SPEED_CONFIG_NAMES) + " (bf16 always runs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels:
        kernels()
        return
    model = str(resolve_model(args.model))
    print(f"model {model}, torch threads {torch.get_num_threads()}")
    if not args.skip_accuracy:
        accuracy(model, args.accuracy_tokens)
    capacity(model)
    if not args.skip_speed:
        names = {SPEED_CONFIG_NAMES[c] for c in args.configs.split(",")} | {"bf16"}
        speed(model, [int(b) for b in args.batches.split(",")], args.tokens, args.repeats,
              tuple(n for n in SPEED_CONFIGS if n in names))


if __name__ == "__main__":
    main()
