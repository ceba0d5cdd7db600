"""Beam search equals transformers' generate(num_beams=k, do_sample=False): same k sequences,
best first. transformers' defaults are matched: early_stopping=False with its length-penalised
heuristic, scores = sum of log-probs / generated_length ** length_penalty."""

from __future__ import annotations

import random
from collections import Counter
from functools import cache

import pytest
import torch

from streamer import LLM, SamplingParams

PAD = 1  # transformers fills with `pad_token_id or eos`: a nonzero id keeps it unambiguous


@cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_beams(path, prompt, k, max_tokens, length_penalty, early_stopping, eos):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(str(path)).generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k, do_sample=False,
            max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
            eos_token_id=eos, pad_token_id=PAD)
    return [row[len(prompt):].tolist() for row in out]


def same_beams(hf: list[list[int]], ours: list[list[int]]) -> bool:
    """transformers pads finished beams to the longest; ours are unpadded."""
    return len(hf) == len(ours) and all(h[:len(o)] == o and set(h[len(o):]) <= {PAD} for h, o in zip(hf, ours))


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256)


@pytest.mark.parametrize("k, max_tokens, length_penalty, early_stopping", [
    (2, 8, 1.0, False), (3, 14, 0.5, False), (4, 20, 1.0, False), (4, 12, 2.0, True), (5, 10, -0.5, False)])
def test_matches_transformers(llm, llama_ckpt, k, max_tokens, length_penalty, early_stopping):
    rng = random.Random(k * 100 + max_tokens)
    prompt = [rng.randrange(8, 512) for _ in range(rng.randint(3, 60))]
    params = SamplingParams(use_beam_search=True, beam_width=k, max_tokens=max_tokens,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    eos = sorted(llm.engine.eos_token_ids)
    ref = hf_beams(llama_ckpt, prompt, k, max_tokens, length_penalty, early_stopping, eos)
    assert same_beams(ref, [c.token_ids for c in out.outputs])
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("early_stopping", [False, True])
def test_matches_transformers_when_beams_end_early(llm, llama_ckpt, early_stopping):
    """Make a frequent token a stop token, so hypotheses finish at different lengths."""
    prompt = [11, 42, 97, 300, 12, 7, 250]
    free = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(use_beam_search=True, beam_width=3, max_tokens=12))[0]
    stop = Counter(free.outputs[0].token_ids[1:]).most_common(1)[0][0]  # a token the beams favour
    params = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=12, stop_token_ids=[stop],
                            early_stopping=early_stopping)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert any(c.finish_reason == "stop" for c in out.outputs)
    eos = sorted(llm.engine.eos_token_ids | {stop})
    ref = hf_beams(llama_ckpt, prompt, 3, 12, 1.0, early_stopping, eos)
    assert same_beams(ref, [c.token_ids for c in out.outputs])


def test_prompt_is_computed_once_and_blocks_are_shared(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompt = list(range(20, 120))  # 100 tokens: 7 blocks
    engine.add_request("beam", {"prompt_token_ids": prompt},
                       SamplingParams(use_beam_search=True, beam_width=4, max_tokens=16))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats()["kv_blocks_used"])
    assert engine.stats()["prompt_tokens_computed"] == 100
    # Unshared, 4 beams of 116 tokens would hold 4 * 8 blocks; sharing keeps the prompt once.
    assert peak <= 6 + 4 * 2
    assert engine.stats()["kv_blocks_used"] == 0


def test_beam_search_under_preemption(llama_ckpt):
    params = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=24)
    prompts = [{"prompt_token_ids": list(range(30 + i, 90 + i))} for i in range(3)]
    tight = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=16, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    roomy = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256, block_size=16).generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in roomy]


def test_an_aborted_beam_search_ends_every_beam_with_its_index(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256, block_size=16)
    engine = llm.engine
    engine.add_request("beam", {"prompt_token_ids": list(range(40, 70))},
                       SamplingParams(use_beam_search=True, beam_width=3, max_tokens=30, ignore_eos=True))
    for _ in range(4):  # a few beam steps: beams forked and reordered
        assert engine.step() == []
    assert engine.abort_request("beam") and not engine.abort_request("beam")
    (out,) = engine.step()
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" and c.token_ids == [] and c.text == "" for c in out.outputs)
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()


def test_beams_stop_at_the_model_length(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=40)
    out = llm.generate({"prompt_token_ids": list(range(50, 80))},
                       SamplingParams(use_beam_search=True, beam_width=2, max_tokens=100, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [10, 10]  # 30 prompt tokens + 10 = max_model_len
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_beam_params_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(use_beam_search=True, beam_width=0)
    with pytest.raises(ValueError, match="n at 1"):
        SamplingParams(use_beam_search=True, n=2)
