"""Reference outputs from Hugging Face transformers for parity tests."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import torch

PROMPT_LENGTHS = [1, 3, 17, 40, 64, 129, 200, 300]
MAX_TOKENS = [24, 8, 30, 5, 17, 12, 20, 9]


def parity_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: the specials (BOS/EOS) would end or reset generation arbitrarily.
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@cache
def hf_greedy(ckpt: Path, prompts: tuple[tuple[int, ...], ...], max_tokens: tuple[int, ...],
              repetition_penalty: float = 1.0, ignore_eos: bool = False) -> list[list[int]]:
    """Greedy continuations from transformers' generate, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model.eval()
    outs = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt])
        extra = {"eos_token_id": None} if ignore_eos else {}
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 repetition_penalty=repetition_penalty, pad_token_id=0, **extra)
        outs.append(gen[0, len(prompt):].tolist())
    return outs
