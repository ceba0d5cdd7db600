"""Sampling parameters, seeded reproducibility, stop conditions, detokenization, aborts."""

from __future__ import annotations

import pytest

from streamer import LLM, QueueFullError, SamplingParams
from streamer.detokenizer import IncrementalDetokenizer
from streamer.errors import QueueFullError as QFE


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=128, seed=0)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = ids(llm.generate("Redis streams carry jobs", p))
    # Same request batched among others, with unseeded neighbours drawing from the global generator.
    noisy = [SamplingParams(temperature=1.0, max_tokens=20)] * 3
    batched = llm.generate(["a", "Redis streams carry jobs", "b", "c"], [noisy[0], p, noisy[1], noisy[2]])
    assert batched[1].outputs[0].token_ids == alone[0]
    other_seed = ids(llm.generate("Redis streams carry jobs", SamplingParams(temperature=1.0, seed=99, max_tokens=20)))
    assert other_seed != alone


def test_top_k_one_is_greedy(llm):
    greedy = ids(llm.generate("The quick brown", SamplingParams(temperature=0, max_tokens=15)))
    top1 = ids(llm.generate("The quick brown", SamplingParams(temperature=0.8, top_k=1, max_tokens=15, seed=5)))
    assert greedy == top1


def test_min_p_and_top_p_restrict_support(llm):
    # With top_p tiny only the most likely token survives: equals greedy.
    greedy = ids(llm.generate("Tokens flow back", SamplingParams(temperature=0, max_tokens=10)))
    nucleus = ids(llm.generate("Tokens flow back", SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, seed=1)))
    min_p = ids(llm.generate("Tokens flow back", SamplingParams(temperature=1.5, min_p=1.0, max_tokens=10, seed=1)))
    assert greedy == nucleus == min_p


def test_logprobs_are_reported(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy: the chosen token is the top one
        assert max(entry.values()) == entry[token] <= 0.0


def test_stop_string_ends_and_is_trimmed(llm):
    base = llm.generate("naïve café", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate("naïve café", SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.find(stop)]
    kept = llm.generate("naïve café", SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[: base.text.find(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate("emoji", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    stop_id = base[4]
    first = base.index(stop_id)
    out = llm.generate("emoji", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base[: first + 1] and out.stop_reason == stop_id
    later = llm.generate("emoji", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id],
                                                 min_tokens=first + 2))[0].outputs[0]
    assert len(later.token_ids) > first + 1


def test_streamed_text_deltas_equal_full_decode(llm):
    engine = llm.engine
    engine.add_request("utf8", "日本語のテキスト 🙂🚀", SamplingParams(temperature=1.0, seed=7, max_tokens=40))
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
    assert text == llm.tokenizer.decode(tokens, skip_special_tokens=True)


def test_abort_frees_blocks_within_a_step(llm):
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": list(range(10, 200))}, SamplingParams(max_tokens=200))
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort_request("long")
    assert engine.stats()["kv_blocks_used"] == 0
    final = engine.step()
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert not engine.abort_request("long") and not engine.abort_request("never-existed")


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(n=0), "n must"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids=["x"]), "stop_token_ids"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=99), "logprobs"),
    (dict(temperature="hot"), "temperature"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params_raise_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5})
    assert SamplingParams.from_dict({"max_tokens": 3}).max_tokens == 3


def test_bad_prompts_are_rejected_without_side_effects(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="at most"):
        engine.add_request("too-long", {"prompt_token_ids": [5] * 5000}, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [5, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, SamplingParams())
    engine.add_request("dup", "x", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "x", SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_waiting"] == 0 and engine.stats()["kv_blocks_used"] == 0


def test_waiting_queue_is_bounded(llama_ckpt):
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=32, max_waiting_requests=2)
    engine = llm.engine
    engine.add_request("a", "x", SamplingParams(max_tokens=2))
    engine.add_request("b", "x", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="full"):
        engine.add_request("c", "x", SamplingParams(max_tokens=2))
    assert QueueFullError is QFE
    assert engine.stats()["num_waiting"] == 2


def test_n_samples(llm):
    out = llm.generate("Hello", SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Priority order is tested by who is served first in test_engine_boundaries.py.


def test_resume_continues_exactly(llm):
    p = SamplingParams(temperature=0.9, seed=42, max_tokens=16)
    full = llm.generate("Resume me", p)[0].outputs[0]
    engine = llm.engine
    engine.add_request("resumed", "Resume me", p, resume_token_ids=[full.token_ids[:6]])
    tokens, text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
    assert full.token_ids[:6] + tokens == full.token_ids
    # What a client had already received from the first run: the streamed text of 6 tokens.
    streamed = IncrementalDetokenizer(llm.tokenizer.backend_tokenizer, engine.tokenize("Resume me").token_ids, p)
    for t in full.token_ids[:6]:
        streamed.append(t, check_stop=False)
    assert streamed.text + text == full.text
