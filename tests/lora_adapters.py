"""Random PEFT LoRA adapters for the tests, built with the `peft` library itself, and the
transformers + PEFT reference (the adapter merged into the base weights)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(base: Path, out: Path, seed: int, rank: int = 8, alpha: float = 16.0,
                  targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False) -> Path:
    """A PEFT adapter of `base` with random A and B (B is zero at PEFT's default init, which would
    make the adapter a no-op) scaled so it changes greedy tokens, saved in PEFT's format."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out))
    return out


@cache
def peft_greedy(base: Path, adapter: Path | None, prompts: tuple[tuple[int, ...], ...], max_tokens: int
                ) -> list[list[int]]:
    """Greedy continuations by transformers with the adapter merged (`merge_and_unload`), in float32,
    one prompt at a time; `adapter` None: the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        outs.append(gen[0, len(prompt):].tolist())
    return outs
