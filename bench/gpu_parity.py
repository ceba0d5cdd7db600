"""Greedy parity with transformers on the device (step 3 of bench/gpu_check.py).

    python -m bench.gpu_parity [--smoke]

A random Llama and a random Qwen2 (QKV bias, tied embeddings) are built on the spot; each generates
greedily in float32 and in bfloat16, through transformers' `generate` and through streamer, on the
same device (CUDA, or the CPU with --smoke). float32 must match token for token. bfloat16 rounds
differently in the two implementations, so there a prompt counts as matching while its tokens agree
and the check asks only that every prompt's first token agrees; the share of matching tokens is
reported. On CUDA each runs twice, CUDA graphs on and off (`enforce_eager`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from streamer import LLM, SamplingParams
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint


def specs(smoke: bool) -> dict[str, TinyModelSpec]:
    if smoke:
        return {"llama": TinyModelSpec(arch="llama"),
                "qwen2": TinyModelSpec(arch="qwen2", num_attention_heads=8, tie_word_embeddings=True)}
    size = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, vocab_size=4096,
                max_position_embeddings=2048)
    return {"llama": TinyModelSpec(arch="llama", num_attention_heads=8, num_key_value_heads=2, **size),
            "qwen2": TinyModelSpec(arch="qwen2", num_attention_heads=8, num_key_value_heads=2,
                                   tie_word_embeddings=True, **size)}


def prompts(vocab: int, smoke: bool) -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 17, 40] if smoke else [1, 3, 17, 40, 64, 129, 200, 300]
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(ckpt: Path, dtype: str, device: str, batch: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).to(device).eval()
    outs = []
    for p in batch:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(gen[0, len(p):].tolist())
    return outs


def streamer_greedy(ckpt: Path, dtype: str, device: str, batch: list[list[int]], n: int,
                    eager: bool | None) -> list[list[int]]:
    options = {} if eager is None else {"enforce_eager": eager}
    with LLM(model=str(ckpt), dtype=dtype, device=device, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, bool]:
    """Share of tokens before each prompt's first divergence; whether every first token agrees."""
    same = 0
    for a, b in zip(ours, ref):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += k
    return same / sum(map(len, ref)), all(a[:1] == b[:1] for a, b in zip(ours, ref))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    n = 8 if args.smoke else 24
    modes: list[bool | None] = [True, False] if device == "cuda" else [None]  # enforce_eager; None: CPU
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for arch, spec in specs(args.smoke).items():
            ckpt = build_checkpoint(Path(tmp) / arch, spec, seed=1)
            batch = prompts(spec.vocab_size, args.smoke)
            for dtype in ("float32", "bfloat16"):
                ref = hf_greedy(ckpt, dtype, device, batch, n)
                for eager in modes:
                    share, first = agreement(streamer_greedy(ckpt, dtype, device, batch, n, eager), ref)
                    good = share == 1.0 if dtype == "float32" else first
                    ok &= good
                    graphs = {None: "eager (CPU: no CUDA graphs)", True: "eager", False: "CUDA graphs"}[eager]
                    rows.append({"arch": arch, "dtype": dtype, "mode": graphs, "token_match": round(share, 3),
                                 "ok": good})
                    verdict = "ok" if good else "MISMATCH"
                    print(f"{arch:6} {dtype:8} {graphs:32} tokens matching {share:6.1%}  {verdict}", flush=True)
    worst = {d: min(r["token_match"] for r in rows if r["dtype"] == d) for d in ("float32", "bfloat16")}
    summary = (f"{sum(r['ok'] for r in rows)}/{len(rows)} runs ok; tokens matching: fp32 {worst['float32']:.0%}, "
               f"bf16 >= {worst['bfloat16']:.0%}; {'graphs on+off' if len(modes) == 2 else 'eager only'}")
    print("RESULT " + json.dumps({"ok": ok, "summary": summary, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
