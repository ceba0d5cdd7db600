"""Multi-LoRA in the engine: greedy tokens equal to transformers + PEFT with each adapter merged, with
three adapters and the base model in the same batch (float32); the prefix cache never shares KV
across adapters; eviction with more adapters in use than slots; adapters that cannot be served; a
bfloat16 model's stacks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from lora_adapters import build_adapter, peft_greedy

from streamer import LLM, SamplingParams
from streamer.lora import LoRARequest

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four adapters of the tiny Llama, different in rank, targets and scaling."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": build_adapter(llama_ckpt, root / "all8", seed=11, rank=8),
        "qv4": build_adapter(llama_ckpt, root / "qv4", seed=12, rank=4, targets=("q_proj", "v_proj")),
        "mlp16": build_adapter(llama_ckpt, root / "mlp16", seed=13, rank=16, alpha=8.0,
                               targets=("gate_proj", "up_proj", "down_proj")),
        "rs2": build_adapter(llama_ckpt, root / "rs2", seed=14, rank=2, alpha=4.0, use_rslora=True,
                             targets=("k_proj", "o_proj", "down_proj")),
    }


def _prompts(n: int, seed: int) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(seed)
    return tuple(tuple(rng.randrange(8, 512) for _ in range(rng.choice([3, 17, 40]))) for _ in range(n))


def _llm(ckpt: Path, **kw: object) -> LLM:
    return LLM(str(ckpt), dtype="float32", num_kv_blocks=256, attention_backend="torch", seed=0, **kw)


class StepSpy:
    """Records the distinct adapters of every step the runner runs."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[set[str | None]] = []
        manager = llm.engine.executor.lora
        original = manager.begin_step

        def begin_step(row_loras, sample_rows):  # type: ignore[no-untyped-def]
            self.steps.append({lora.name if lora else None for lora, _ in row_loras})
            return original(row_loras, sample_rows)

        manager.begin_step = begin_step


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def test_mixed_batch_equals_peft_merged(llama_ckpt: Path, adapters: dict[str, Path]) -> None:
    prompts = _prompts(8, seed=1)
    names = [None, "all8", "qv4", "mlp16", None, "all8", "qv4", "mlp16"]
    llm = _llm(llama_ckpt)
    spy = StepSpy(llm)
    loras = [LoRARequest(n, str(adapters[n])) if n else None for n in names]
    outs = llm.generate([list(p) for p in prompts], GREEDY, lora_request=loras)
    for name in set(names):
        idx = [i for i, n in enumerate(names) if n == name]
        expected = peft_greedy(llama_ckpt, adapters[name] if name else None, tuple(prompts[i] for i in idx),
                               MAX_TOKENS)
        assert [outs[i].outputs[0].token_ids for i in idx] == expected, name
    # The adapters change the tokens (else the comparison above proves nothing) ...
    base = peft_greedy(llama_ckpt, None, prompts, MAX_TOKENS)
    assert all(outs[i].outputs[0].token_ids != base[i] for i, n in enumerate(names) if n)
    # ... and all four ran in the same steps: one batch, never one adapter per step.
    assert {None, "all8", "qv4", "mlp16"} in spy.steps
    assert llm.stats()["loras"] and set(llm.stats()["loras"]) == {"all8", "qv4", "mlp16"}


def test_rslora_and_partial_targets(llama_ckpt: Path, adapters: dict[str, Path]) -> None:
    prompts = _prompts(3, seed=2)
    llm = _llm(llama_ckpt)
    outs = llm.generate([list(p) for p in prompts], GREEDY, lora_request=LoRARequest("rs2", str(adapters["rs2"])))
    assert [o.outputs[0].token_ids for o in outs] == peft_greedy(llama_ckpt, adapters["rs2"], prompts, MAX_TOKENS)


def test_prefix_cache_is_per_adapter(llama_ckpt: Path, adapters: dict[str, Path]) -> None:
    prompt = list(_prompts(1, seed=3)[0]) + list(range(100, 160))  # several full blocks
    llm = _llm(llama_ckpt)
    a = LoRARequest("all8", str(adapters["all8"]))
    b = LoRARequest("qv4", str(adapters["qv4"]))
    runs = [(None, 0), (a, 0), (b, 0), (a, 1), (None, 1)]
    for lora, warm in runs:
        out = llm.generate(prompt, GREEDY, lora_request=lora)[0]
        # A prompt seen before under the same adapter (or none) hits; under another, nothing is shared.
        assert (out.num_cached_tokens > 0) == bool(warm), (lora, out.num_cached_tokens)
        expected = peft_greedy(llama_ckpt, Path(lora.path) if lora else None, (tuple(prompt),), MAX_TOKENS)
        assert out.outputs[0].token_ids == expected[0]


def test_eviction_with_more_adapters_than_slots(llama_ckpt: Path, adapters: dict[str, Path]) -> None:
    prompts = _prompts(8, seed=4)
    names = ["all8", "qv4", "mlp16", "rs2"] * 2
    llm = _llm(llama_ckpt, max_loras=2)
    spy = StepSpy(llm)
    loras = [LoRARequest(n, str(adapters[n])) for n in names]
    outs = llm.generate([list(p) for p in prompts], GREEDY, lora_request=loras)
    for i, name in enumerate(names):
        assert outs[i].outputs[0].token_ids == peft_greedy(llama_ckpt, adapters[name], (prompts[i],), MAX_TOKENS)[0]
    assert max(len(s) for s in spy.steps) == 2  # two slots: never more adapters in a step
    manager = llm.engine.executor.lora
    assert manager.num_loads >= 4 and len(manager.loaded()) == 2
    # Least recently used goes first: using the older of the two loaded brings it to the end.
    older, newer = manager.loaded()
    llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest(older, str(adapters[older])))
    assert manager.loaded() == [newer, older]
    evicted = next(n for n in adapters if n not in (older, newer))
    llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest(evicted, str(adapters[evicted])))
    assert manager.loaded() == [older, evicted]


def test_adapters_that_cannot_be_served(llama_ckpt: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    llm = _llm(llama_ckpt, max_lora_rank=8)
    engine = llm.engine
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_request("missing", [1, 2, 3], GREEDY, lora_request=LoRARequest("x", str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank 8"):
        engine.add_request("big", [1, 2, 3], GREEDY, lora_request=LoRARequest("m", str(adapters["mlp16"])))
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING", "r": 4}))
    with pytest.raises(ValueError, match="is not LORA"):
        engine.add_request("pt", [1, 2, 3], GREEDY, lora_request=LoRARequest("pt", str(other)))
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests  # nothing queued
    out = llm.generate([5, 6, 7], GREEDY, lora_request=LoRARequest("all8", str(adapters["all8"])))[0]
    assert out.outputs[0].token_ids == peft_greedy(llama_ckpt, adapters["all8"], ((5, 6, 7),), MAX_TOKENS)[0]


def test_no_lora_engine_refuses_adapters(llama_ckpt: Path, adapters: dict[str, Path]) -> None:
    llm = _llm(llama_ckpt, max_loras=0)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        llm.generate([1, 2], GREEDY, lora_request=LoRARequest("all8", str(adapters["all8"])))


def test_bfloat16_model_reads_bfloat16_stacks(llama_ckpt: Path, adapters: dict[str, Path]) -> None:
    """A bfloat16 model keeps its CPU stacks in bfloat16 where the compiled kernel runs (half the bytes
    a decode step reads); its adapted first tokens then agree with the float32 PEFT-merged reference
    as bfloat16's agree with float32 (test_family_parity), and not by being the base model's."""
    prompts = _prompts(16, seed=3)
    names = ["all8", "qv4", "mlp16", "rs2"] * 4
    llm = LLM(str(llama_ckpt), dtype="bfloat16", num_kv_blocks=256, seed=0)
    loras = [LoRARequest(n, str(adapters[n])) for n in names]
    outs = llm.generate([list(p) for p in prompts], SamplingParams(max_tokens=1, temperature=0), lora_request=loras)
    stacks = list(llm.engine.executor.lora.stacks.values())
    assert stacks and all(s.a.dtype == s.b.dtype == torch.bfloat16 for s in stacks)
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    adapted = [peft_greedy(llama_ckpt, adapters[n], (p,), 1)[0][0] for n, p in zip(names, prompts)]
    base = [t[0] for t in peft_greedy(llama_ckpt, None, prompts, 1)]
    changed = [i for i in range(len(prompts)) if adapted[i] != base[i]]
    assert len(changed) >= 8  # the adapters move these first tokens ...
    assert sum(firsts[i] == adapted[i] for i in changed) >= len(changed) - 2  # ... and bfloat16 follows them
