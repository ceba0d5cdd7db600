"""Prefix caching never reuses KV computed for another position or another context.

A block's cache key chains its parent's key, so equal token blocks only match when everything
before them matches too. These prompts reuse whole blocks of an earlier prompt in other places
(its tail, its middle with another first block, one block repeated inside a prompt): each must
still get exactly transformers' greedy tokens, and the cache may report hits only for true
prefixes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from parity import hf_greedy

from streamer import LLM, SamplingParams

BS = 16
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def blocks(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 512) for _ in range(BS)] for _ in range(count)]


X, B, C, Y, T1, T2, T3, T4, T5, T6 = blocks(0, 10)

# (name, prompt, prompt tokens the cache may serve), run in this order on one engine.
CASES = [
    ("first", X + B + C + T1[:5], 0),
    ("its tail", B + C + T2[:4], 0),  # A's blocks 1-2 at positions 0-1
    ("its middle after another block", Y + B + C + T3[:3], 0),  # same positions, other context
    ("one block repeated", B + B + B + T4[:6], BS),  # its first block is "its tail"'s first
    ("true prefix of the repeated one", B + B + T5[:2], 2 * BS),
    ("true prefix of the first", X + B + T6[:7], 2 * BS),
    ("the first again, whole", X + B + C + T1[:5], 3 * BS),
]


@pytest.fixture(scope="module")
def reference(llama_ckpt: Path) -> list[list[int]]:
    prompts = tuple(tuple(p) for _, p, _ in CASES)
    return hf_greedy(llama_ckpt, prompts, (MAX_TOKENS,) * len(CASES), ignore_eos=True)


def test_blocks_reused_elsewhere_give_transformers_tokens_one_by_one(llama_ckpt: Path, reference) -> None:
    llm = LLM(str(llama_ckpt), dtype="float32", block_size=BS, num_kv_blocks=128, enable_prefix_caching=True)
    hits = 0
    for (name, prompt, cached), want in zip(CASES, reference):
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert out.outputs[0].token_ids == want, name
        assert out.num_cached_tokens == cached, name
        hits += cached
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == hits
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for _, p, _ in CASES)


def test_blocks_reused_elsewhere_in_one_batch(llama_ckpt: Path, reference) -> None:
    """The same prompts all at once, once the first prompt's blocks are cached."""
    llm = LLM(str(llama_ckpt), dtype="float32", block_size=BS, num_kv_blocks=128, enable_prefix_caching=True)
    llm.generate({"prompt_token_ids": CASES[0][1]}, GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for _, p, _ in CASES], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # True prefixes of the cached first prompt hit. Prefixes shared only with a batch-mate may or
    # may not hit (that depends on when blocks become shareable); the rest never hit.
    allowed = [{3 * BS}, {0}, {0}, {0, BS}, {0, 2 * BS}, {2 * BS}, {3 * BS}]
    assert all(o.num_cached_tokens in a for o, a in zip(outs, allowed)), [o.num_cached_tokens for o in outs]
