"""Prefix caching and parallel sampling share physical KV blocks without changing outputs."""

from __future__ import annotations

import random

import pytest
from test_block_manager import make_seq, take_prefix

from streamer import LLM, SamplingParams
from streamer.block_manager import BlockManager

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def shared_prefix_prompts(n: int, prefix_len: int = 200, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(8, 512) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(8, 512) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def test_outputs_identical_with_and_without_prefix_caching(llama_ckpt):
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(6)]
    cached = LLM(str(llama_ckpt), dtype="float32", enable_prefix_caching=True, num_kv_blocks=256)
    plain = LLM(str(llama_ckpt), dtype="float32", enable_prefix_caching=False, num_kv_blocks=256)
    # Run one request first so the others find its prefix cached.
    cached.generate(prompts[0], GREEDY)
    with_cache = [o.outputs[0].token_ids for o in cached.generate(prompts, GREEDY)]
    without = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    assert with_cache == without
    assert cached.stats()["prefix_cache_hit_tokens"] >= 6 * 192
    assert plain.stats()["prefix_cache_hit_tokens"] == 0


def test_simultaneous_arrivals_compute_the_shared_prefix_once(llama_ckpt):
    """32 requests sharing a 200-token prefix submitted together: 31 hit the 12 full blocks the
    first one computes in the same batch, and every output equals the uncached engine's."""
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(32, seed=3)]
    cached = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=512, block_size=16)
    plain = LLM(str(llama_ckpt), dtype="float32", enable_prefix_caching=False, num_kv_blocks=512, block_size=16)
    with_cache = cached.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in with_cache] == [o.outputs[0].token_ids for o in
                                                            plain.generate(prompts, GREEDY)]
    assert sorted(o.num_cached_tokens for o in with_cache) == [0] + [192] * 31
    stats = cached.stats()
    assert stats["prefix_cache_hit_tokens"] == 31 * 192
    assert stats["prompt_tokens_computed"] == sum(len(p["prompt_token_ids"]) for p in prompts) - 31 * 192


def test_second_request_computes_only_its_suffix(llama_ckpt):
    first, second = shared_prefix_prompts(2, prefix_len=200, seed=1)
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256, block_size=16)
    llm.generate({"prompt_token_ids": first}, GREEDY)  # finishes: its blocks are freed but stay cached
    assert llm.stats()["kv_blocks_used"] == 0
    before = llm.stats()["prompt_tokens_computed"]
    out = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    computed = llm.stats()["prompt_tokens_computed"] - before
    full_prefix_blocks = 200 // 16  # 12 full blocks = 192 tokens shared
    assert out.num_cached_tokens == full_prefix_blocks * 16
    assert computed == len(second) - full_prefix_blocks * 16
    stats = llm.stats()
    assert stats["prefix_cache_query_tokens"] == len(first) + len(second)
    assert stats["prefix_cache_hit_tokens"] == 192


def test_fully_cached_prompt_still_computes_its_last_token(llama_ckpt):
    prompt = {"prompt_token_ids": shared_prefix_prompts(1, prefix_len=64, seed=2)[0][:64]}
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, block_size=16)
    a = llm.generate(prompt, GREEDY)[0]
    b = llm.generate(prompt, GREEDY)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.num_cached_tokens == 48  # the last full block is recomputed to produce logits


def test_eviction_is_lru_with_exact_block_ids():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a, b = make_seq(4), make_seq(4)
    b.token_ids = [9, 9, 8, 8]
    for seq in (a, b):
        assert take_prefix(bm, seq) == 0
        assert bm.allocate(seq, 4)
        seq.num_computed_tokens = 4
        bm.cache_full_blocks(seq)
    assert bm.block_table(a) == [0, 1] and bm.block_table(b) == [2, 3]
    bm.free(a)  # freed tail first: queue is 4, 5, 1, 0
    bm.free(b)  # then 3, 2
    assert bm.free_block_ids == [4, 5, 1, 0, 3, 2]
    # New blocks come from the least recently freed end; cached ones are evicted only then.
    c = make_seq(6)
    c.token_ids = [7] * 6
    assert take_prefix(bm, c) == 0 and bm.allocate(c, 6)
    assert bm.block_table(c) == [4, 5, 1]  # block 1 (a's second block) evicted
    again = make_seq(4)  # a's tokens: its first block is still cached, the second was evicted
    assert take_prefix(bm, again) == 2 and bm.block_table(again) == [0]
    assert bm.free_block_ids == [3, 2]


def test_parallel_samples_share_prompt_blocks(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256, block_size=16)
    engine = llm.engine
    prompt = {"prompt_token_ids": shared_prefix_prompts(1, prefix_len=100, seed=3)[0][:100]}  # 6.25 blocks
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))
    engine.step()  # prefill by sample 0; samples 1-3 fork from it
    # 7 prompt blocks held once; the partly filled 7th is shared until the first divergent write.
    assert engine.stats()["kv_blocks_used"] == 7
    engine.step()  # each sample writes its own token: the shared 7th block is copied for 3 of them
    assert engine.stats()["kv_blocks_used"] == 6 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0


def test_parallel_samples_equal_single_seeded_requests(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=17, max_tokens=15)
    group = llm.generate("Tokens flow back over pub/sub", params)[0]
    again = llm.generate("Tokens flow back over pub/sub", params)[0]
    assert [c.token_ids for c in group.outputs] == [c.token_ids for c in again.outputs]
    for i, sample in enumerate(group.outputs):
        single = llm.generate("Tokens flow back over pub/sub",
                              SamplingParams(temperature=1.0, top_p=0.95, seed=17 + i, max_tokens=15))[0]
        assert sample.token_ids == single.outputs[0].token_ids


@pytest.mark.parametrize("num_kv_blocks", [256, 14])
def test_parallel_samples_consistent_under_preemption(llama_ckpt, num_kv_blocks):
    """Several multi-sample requests in a tight cache: samples are preempted and recomputed,
    and every sample still equals its unconstrained result."""
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=num_kv_blocks, block_size=16)
    params = SamplingParams(n=3, temperature=1.0, seed=23, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(3, prefix_len=40, seed=4)]
    outs = llm.generate(prompts, params)
    reference = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=256, block_size=16).generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in reference]
    if num_kv_blocks == 14:
        assert llm.stats()["num_preemptions"] > 0
