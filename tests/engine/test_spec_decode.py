"""Speculative decoding (prompt lookup): greedy output token for token what decoding without drafts
gives (and transformers), under every batching the parity suite uses; sampled output distributed as
without drafts (the rejection rule against the sampler's own distribution); the counters vLLM exports."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from parity import hf_greedy, parity_prompts
from test_fault_isolation import PoisonedRunner
from test_fault_isolation import run as run_steps

from streamer import LLM, SamplingParams
from streamer.errors import ConfigError
from streamer.request import Sequence
from streamer.sampler import Sampler
from streamer.spec_decode.config import SpeculativeConfig
from streamer.spec_decode.ngram_proposer import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


# ---- the proposer ------------------------------------------------------------------------------
def proposer(lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_proposes_what_followed_the_most_recent_earlier_match_of_the_longest_suffix():
    # Suffix [5, 6, 7] occurred at 0 (followed by 1, 2) and [6, 7] at 8 (followed by 9): the
    # longest suffix wins over the more recent shorter one.
    tokens = [5, 6, 7, 1, 2, 3, 4, 0, 6, 7, 9, 8, 5, 6, 7]
    assert proposer().propose(tokens, 2) == [1, 2]
    # The most recent of two equal matches.
    assert proposer().propose([1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]


def test_proposes_at_most_k_tokens_and_stops_at_the_end_of_the_history():
    assert proposer().propose([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]
    assert proposer().propose([1, 2, 3, 4, 1, 2], 1) == [3]
    assert proposer().propose([1, 2, 3, 4, 1, 2], 0) == []


def test_proposes_nothing_without_a_match_of_min_n_tokens():
    assert proposer(lo=2).propose([1, 2, 3, 9, 3], 3) == []  # only [3] repeats: shorter than 2
    assert proposer(lo=1).propose([1, 2, 3, 9, 3], 3) == [9, 3]
    assert proposer().propose([4], 3) == []


def test_config_refuses_unknown_keys_and_values_out_of_range():
    with pytest.raises(ConfigError, match="unknown speculative_config key"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_lookahead": 3})
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig.from_dict({"method": "medusa"})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="prompt_lookup"):
        SpeculativeConfig.from_dict({"prompt_lookup_min": 5, "prompt_lookup_max": 2})


# ---- greedy: exactly the tokens of decoding without drafts -------------------------------------
def looping_prompts(vocab: int) -> list[list[int]]:
    """The parity prompts, and prompts that repeat a phrase: their continuations repeat it too
    (a tiny random model loops), so guesses are made and kept."""
    rng = random.Random(3)
    phrases = [[rng.randrange(8, vocab) for _ in range(n)] for n in (3, 5, 8)]
    return parity_prompts(vocab) + [p * r for p, r in zip(phrases, (9, 6, 4))]


MAX = 40


def generate(ckpt: Path, prompts: list[list[int]], params: list[SamplingParams], **kwargs) -> tuple[list, dict]:
    with LLM(str(ckpt), dtype="float32", **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return outs, llm.stats()


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, n=n)


def assert_drafts_were_kept(stats: dict) -> None:
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] and per_pos[0] >= per_pos[-1]


@pytest.mark.parametrize("ckpt_name, batching", [
    ("llama_ckpt", dict(block_size=8, max_num_batched_tokens=160, num_kv_blocks=512)),  # mixed, chunked
    ("qwen2_ckpt", dict(block_size=32, max_num_batched_tokens=160, num_kv_blocks=512)),
    ("llama_ckpt", dict(block_size=16, num_kv_blocks=56, max_num_batched_tokens=512)),  # preemption
    ("llama_ckpt", dict(max_num_batched_tokens=16, num_kv_blocks=256)),  # drafts cut by a tiny budget
    ("llama_ckpt", dict(attention_backend="torch", max_num_batched_tokens=160, num_kv_blocks=512)),
])
def test_greedy_tokens_equal_transformers_and_decoding_without_drafts(request, ckpt_name, batching):
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = looping_prompts(512)
    params = [greedy()] * len(prompts)
    got, stats = generate(ckpt, prompts, params, speculative_config=NGRAM, **batching)
    tokens = [o.outputs[0].token_ids for o in got]
    assert tokens == hf_greedy(ckpt, tuple(map(tuple, prompts)), (MAX,) * len(prompts), ignore_eos=True)
    assert_drafts_were_kept(stats)
    assert stats["max_step_tokens"] <= batching["max_num_batched_tokens"]
    assert stats["kv_blocks_used"] == 0
    if batching.get("num_kv_blocks") == 56:
        assert stats["num_preemptions"] > 0


def test_text_stop_strings_samples_and_rows_that_cannot_draft_equal_decoding_without_drafts(llama_ckpt):
    """Parallel samples, a stop string met among kept drafts, max_tokens met among them, and rows
    that decode one token a step (logprobs, penalties) mixed into the same batches."""
    prompts = looping_prompts(512)
    plain, _ = generate(llama_ckpt, prompts[-3:], [greedy()] * 3, num_kv_blocks=256)
    text = plain[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        greedy(n=2),
        SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, repetition_penalty=1.3),
    ]
    batch = [prompts[-3], prompts[-2], prompts[-1], prompts[-2], prompts[-1]]
    want, _ = generate(llama_ckpt, batch, params, num_kv_blocks=256)
    got, stats = generate(llama_ckpt, batch, params, num_kv_blocks=256, speculative_config=NGRAM)
    assert_drafts_were_kept(stats)
    for g, w in zip(got, want):
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs]
    # Log-probs: the same tokens, values as close as other batchings give (the GEMMs' row counts differ).
    got_lp, want_lp = got[3].outputs[0].logprobs, want[3].outputs[0].logprobs
    assert [list(a) for a in got_lp] == [list(b) for b in want_lp]
    assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(got_lp, want_lp) for t in a)
    assert got[0].outputs[0].stop_reason == stop and len(got[1].outputs[0].token_ids) == 7


def test_streamed_deltas_add_up_to_the_output_and_several_tokens_come_in_one_delta(llama_ckpt):
    prompt = looping_prompts(512)[-1]
    with LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=128, speculative_config=NGRAM) as llm:
        llm.engine.add_request("r", {"prompt_token_ids": prompt}, greedy())
        deltas = []
        while llm.engine.has_unfinished_requests():
            deltas += [o.outputs[0] for o in llm.engine.step() if o.outputs]
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == hf_greedy(llama_ckpt, (tuple(prompt),), (MAX,), ignore_eos=True)[0]
    assert max(len(d.token_ids) for d in deltas) > 1  # one delta per step, not per token
    plain, _ = generate(llama_ckpt, [prompt], [greedy()], num_kv_blocks=128)
    assert "".join(d.text for d in deltas) == plain[0].outputs[0].text
    assert [d.finish_reason for d in deltas].count("length") == 1


def test_a_failing_request_in_a_drafting_step_is_failed_alone(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", block_size=16, num_kv_blocks=128, speculative_config=NGRAM)
    batch = looping_prompts(512)[-3:] * 2
    ids = [f"r{i}" for i in range(6)]
    params = [greedy()] * 6
    clean = run_steps(llm, batch, ids, params)
    ids[1] = "poison"
    llm.engine.executor = PoisonedRunner(llm.engine.executor, {"poison"}, after=5)
    got = run_steps(llm, batch, ids, params)
    for request_id, clean_id in zip(ids, [f"r{i}" for i in range(6)]):
        if request_id != "poison":
            assert got[request_id]["tokens"] == clean[clean_id]["tokens"]
    assert got["poison"]["reasons"] == {0: "error"}
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


# ---- sampled: distributed as without drafts ----------------------------------------------------
def sampling_rows(n: int, params: SamplingParams, output_len: int = 0) -> list[Sequence]:
    return [Sequence(request_id=f"s{i}", index=0, token_ids=[1] * (3 + output_len), num_prompt_tokens=3,
                     params=params) for i in range(n)]


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.3),
])
def test_kept_drafts_and_their_replacements_are_distributed_as_the_target(params):
    """Two drafts per sequence over a 64-token vocabulary: a likely one, then an unlikely one. The
    first emitted token must follow p_0 whatever the drafts were; the second, given the first was
    the first draft, must follow p_1 (N = 40,000: sampling noise in total variation ~0.02)."""
    vocab, n = 64, 40_000
    torch.manual_seed(0)
    rows = torch.randn(3, vocab) * 2.5
    sampler = Sampler(set(), seed=5)
    seqs = sampling_rows(n, params)
    p = [sampler.probabilities(rows[j:j + 1], seqs[:1])[0] for j in range(3)]
    likely, unlikely = int(p[0].argmax()), int(p[1].argsort()[-6])
    out = sampler.with_drafts(rows.repeat(n, 1), seqs, [[likely, unlikely]] * n)
    emitted = [(a + [t])[:2] for a, t in zip(out.accepted, out.token_ids)]  # type: ignore[arg-type]
    first = torch.tensor([e[0] for e in emitted])
    assert total_variation(first, p[0]) < 0.02
    second = torch.tensor([e[1] for e in emitted if e[0] == likely and len(e) > 1])
    assert len(second) > 0.3 * n
    assert total_variation(second, p[1]) < 0.03
    # Kept as often as the target gives the draft: p_0(likely) of the time.
    kept = sum(1 for a in out.accepted if a)  # type: ignore[union-attr]
    assert abs(kept / n - float(p[0][likely])) < 0.01


def test_greedy_and_sampled_sequences_verify_in_one_batch():
    vocab = 64
    torch.manual_seed(1)
    rows = torch.randn(3, vocab) * 3
    target = rows.argmax(dim=-1).tolist()
    seqs = sampling_rows(1, SamplingParams(temperature=0.0)) + sampling_rows(1, SamplingParams(temperature=0.9))
    drafts = [[target[0], (target[1] + 1) % vocab], [1, 2]]
    out = Sampler(set(), seed=0).with_drafts(torch.cat([rows, rows]), seqs, drafts)
    # Greedy: the first draft is the argmax (kept), the second is not (replaced by the argmax).
    assert out.accepted[0] == [target[0]] and out.token_ids[0] == target[1]  # type: ignore[index]
    assert out.logprobs == [None, None]


def test_seeded_sampled_output_with_drafts_is_the_same_however_it_is_batched(llama_ckpt):
    prompts = looping_prompts(512)
    seeded = SamplingParams(temperature=0.7, top_k=20, max_tokens=MAX, ignore_eos=True, seed=11)
    alone, _ = generate(llama_ckpt, prompts[-1:], [seeded], num_kv_blocks=256, speculative_config=NGRAM)
    batched, stats = generate(llama_ckpt, prompts[-3:], [greedy(), greedy(n=2), seeded], num_kv_blocks=256,
                              max_num_batched_tokens=64, speculative_config=NGRAM)
    assert batched[-1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert stats["spec_decode_num_accepted_tokens"] > 0


# ---- served: the worker's flag, its token events and vLLM's counters -------------------------
@pytest.mark.anyio
async def test_a_worker_started_with_speculative_config_streams_the_same_tokens_and_exports_acceptance(
        llama_ckpt, redis_url):
    import json

    from redis_worker_helpers import read_events, tokens_of, wait_for, worker_process
    from test_worker_metrics import scrape, value

    from clients.redis_client import AsyncClient
    from workers.redis_server import free_port

    prompt = looping_prompts(512)[-1]
    port = free_port()
    worker = worker_process(llama_ckpt, redis_url, "--speculative-config", json.dumps(NGRAM),
                            "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    try:
        async with AsyncClient(redis_url) as client:
            result = await client.generate(prompt_token_ids=prompt, params={"temperature": 0, "ignore_eos": True,
                                                                            "max_tokens": MAX}, timeout=120,
                                           wait_for_worker=True)
        events = read_events(redis_url, result.id)
        await wait_for(lambda: value(scrape(port), "vllm:spec_decode_num_drafts_total"), timeout=10)
        samples = scrape(port)
    finally:
        worker.terminate()
        worker.wait(30)
    assert tokens_of(events) == hf_greedy(llama_ckpt, (tuple(prompt),), (MAX,), ignore_eos=True)[0]
    assert any(len(e["token_ids"]) > 1 for e in events if e["type"] == "token")
    accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < value(samples, "vllm:spec_decode_num_draft_tokens_total")
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert sum(v for (n, _), v in samples.items()
               if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_tensor_parallel_ranks_verify_the_drafts_rank_0_makes(llama_ckpt):
    """The drafts travel in the flattened step like any token: two ranks (gloo processes) give the
    tokens one device gives without drafts."""
    prompts = looping_prompts(512)[-3:]
    got, stats = generate(llama_ckpt, prompts, [greedy()] * 3, tensor_parallel_size=2, num_kv_blocks=64,
                          speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in got] == \
        hf_greedy(llama_ckpt, tuple(map(tuple, prompts)), (MAX,) * 3, ignore_eos=True)
    assert_drafts_were_kept(stats)


# ---- a draft model -----------------------------------------------------------------------------
def draft(path: Path, k: int = 3) -> dict:
    return {"model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("batching", [
    dict(max_num_batched_tokens=160, num_kv_blocks=512),
    dict(block_size=16, num_kv_blocks=56, max_num_batched_tokens=512),  # preemption
    dict(max_num_batched_tokens=16, num_kv_blocks=256),  # the draft's catch-up chunked too
])
def test_a_draft_model_that_is_the_target_guesses_every_greedy_token(llama_ckpt, batching):
    """The target as its own draft: every guess is the target's own choice, so nearly all are kept,
    and the output is transformers' token for token (numerics of the batches differ, nothing else)."""
    prompts = looping_prompts(512)
    got, stats = generate(llama_ckpt, prompts, [greedy()] * len(prompts), speculative_config=draft(llama_ckpt),
                          **batching)
    assert [o.outputs[0].token_ids for o in got] == \
        hf_greedy(llama_ckpt, tuple(map(tuple, prompts)), (MAX,) * len(prompts), ignore_eos=True)
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"] > 0
    if batching["num_kv_blocks"] == 56:
        assert stats["num_preemptions"] > 0


def test_a_different_draft_model_changes_nothing_but_the_speed(llama_ckpt, tmp_path):
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    other = build_checkpoint(tmp_path / "draft", TinyModelSpec(arch="llama", num_hidden_layers=1), seed=5)
    prompts = looping_prompts(512)[-4:]
    params = [greedy(), greedy(n=2), SamplingParams(temperature=0.8, top_k=20, max_tokens=MAX, ignore_eos=True,
                                                    seed=3), greedy()]
    got, stats = generate(llama_ckpt, prompts, params, num_kv_blocks=256, speculative_config=draft(other, 4))
    want = hf_greedy(llama_ckpt, tuple(map(tuple, prompts)), (MAX,) * 4, ignore_eos=True)
    assert [got[i].outputs[0].token_ids for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    assert got[1].outputs[1].token_ids == want[1]
    assert len(got[2].outputs[0].token_ids) == MAX
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_draft_model_config_is_checked(llama_ckpt, tmp_path):
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    with pytest.raises(ConfigError, match="draft_model method takes a draft checkpoint"):
        SpeculativeConfig.from_dict({"method": "draft_model"})
    with pytest.raises(ConfigError, match="ngram takes none"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "x"})
    assert SpeculativeConfig.from_dict({"model": "x"}).method == "draft_model"  # as vLLM infers it
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        LLM(str(llama_ckpt), tensor_parallel_size=2, speculative_config=draft(llama_ckpt))
    wide = build_checkpoint(tmp_path / "wide", TinyModelSpec(arch="llama", vocab_size=640), seed=5)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64, speculative_config=draft(wide))


@pytest.mark.anyio
async def test_multi_token_deltas_read_whole_by_the_openai_sdk_and_a_plain_sse_reader(llama_ckpt, redis_url):
    """With drafts kept, one step sends several tokens in one SSE message: the official SDK and a
    plain line-by-line reader both get the whole answer (as vLLM's benchmark client reads it: the
    `text` of each `data:` line), in fewer messages than tokens."""
    import httpx
    import openai
    from redis_worker_helpers import running_worker
    from test_gateway import config

    from workers.gateway.server import running_gateway

    prompt = looping_prompts(512)[-1]
    body = {"model": str(llama_ckpt), "prompt": prompt, "max_tokens": MAX, "temperature": 0, "ignore_eos": True}
    async with running_worker(llama_ckpt, redis_url, engine={"speculative_config": NGRAM}), \
            running_gateway(config(redis_url)) as gw:
        sdk = openai.AsyncOpenAI(base_url=gw.url + "v1", api_key="none")
        sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"} | {"extra_body": {"ignore_eos": True}}
        whole = await sdk.completions.create(**sdk_body)
        streamed = await sdk.completions.create(**sdk_body, stream=True)
        sdk_text = "".join([chunk.choices[0].text async for chunk in streamed if chunk.choices])
        texts = []
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
        await sdk.close()
    assert whole.usage.completion_tokens == MAX
    assert sdk_text == "".join(texts) == whole.choices[0].text
    assert len([t for t in texts if t]) < MAX  # several tokens in at least one message
