"""Constrained decoding (params.structured_outputs, xgrammar): with a random-weight checkpoint, whose
unconstrained output is garbage, every seeded sampled output validates against its JSON schema,
regex, choice or grammar; unconstrained requests sharing the batch give exactly their own tokens;
a spec that does not compile is refused with nothing else disturbed; a resumed request continues
inside its grammar; a deeply nested schema travels through Redis and a worker."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from redis_worker_helpers import kill_all, running_worker

from clients.redis_client import AsyncClient, RequestFailed
from streamer import EngineConfig, LLMEngine, SamplingParams
from streamer.errors import GrammarError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address", "tags"],
          "properties": {
              "name": {"type": "string", "minLength": 1, "maxLength": 8},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "geo"],
                          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                         "geo": {"type": "object", "additionalProperties": False,
                                                 "required": ["lat", "ok"],
                                                 "properties": {"lat": {"type": "number"},
                                                                "ok": {"type": "boolean"}}}}},
              "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
             "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
             "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}}}
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
COLOURS = ["red", "green", "blue", "dark purple"]
ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "*") term)*\nterm ::= [1-9] | "(" expr ")"'


def arithmetic_ok(text: str) -> bool:
    """A small recursive-descent check of ARITHMETIC (an independent reading of the grammar)."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] in "123456789":
            pos += 1
            return True
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return False

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+*":
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


def json_valid(schema: dict[str, Any]) -> Any:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(_loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return check


CASES = {
    "person": ({"json": PERSON}, json_valid(PERSON)),
    "order": ({"json": json.dumps(ORDER)}, json_valid(ORDER)),  # a schema as JSON text works too
    "date": ({"regex": DATE}, lambda t: re.fullmatch(DATE, t) is not None),
    "choice": ({"choice": COLOURS}, lambda t: t in COLOURS),
    "grammar": ({"grammar": ARITHMETIC}, arithmetic_ok),
}


def _loads(text: str) -> Any:
    """JSON as xgrammar's JSON grammar defines it: a raw control character inside a string (which
    random weights do pick) passes it, as Python's non-strict parser allows."""
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


@pytest.fixture(scope="module")
def engine(llama_ckpt: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=512, max_num_seqs=64))


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: Any = "Write it:") -> dict[str, list]:
    """Token ids and text of each request's samples, run together in one batch."""
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, dict[int, list]] = {rid: {} for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            for c in o.outputs:
                ids, text, _ = out[o.request_id].get(c.index, ([], "", None))
                out[o.request_id][c.index] = (ids + c.token_ids, text + c.text, c.finish_reason or _)
    return {rid: [samples[k] for k in sorted(samples)] for rid, samples in out.items()}


@pytest.mark.parametrize("case", CASES)
def test_fifty_sampled_outputs_all_validate_and_unconstrained_ones_do_not(engine: LLMEngine, case: str) -> None:
    spec, valid = CASES[case]
    constrained = {f"{case}-{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=spec)
                   for i in range(50)}
    free = {f"{case}-free-{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(10)}
    results = run(engine, {**constrained, **free})
    for rid in constrained:
        (_, text, reason), = results[rid]
        assert reason == "stop" and valid(text), (rid, text, reason)
    assert not any(valid(results[rid][0][1]) for rid in free)  # the check can fail: garbage fails it


def test_any_json_object_is_an_object_or_on_its_way_to_one(engine: LLMEngine) -> None:
    """`json_object` bounds nothing (a key may run on for ever with random weights): what stops is an
    object, what runs out of tokens is an unfinished one."""
    results = run(engine, {f"obj-{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=150,
                                                      structured_outputs={"json_object": True}) for i in range(20)})
    done = [text for ((_, text, reason),) in results.values() if reason == "stop"]
    cut = [text for ((_, text, reason),) in results.values() if reason == "length"]
    assert done and all(isinstance(_loads(t), dict) for t in done), done
    assert all(t.startswith("{") and _loads(t) is None for t in cut), cut


def test_unconstrained_requests_in_a_mixed_batch_give_exactly_their_own_tokens(engine: LLMEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = run(engine, {"alone-a": greedy, "alone-b": greedy}, prompt="The same prompt")
    mixed = run(engine, {"mix-a": greedy, "mix-b": greedy,
                         **{f"mix-c{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=100,
                                                        structured_outputs={"json": PERSON}) for i in range(6)}},
                prompt="The same prompt")
    assert mixed["mix-a"][0][0] == alone["alone-a"][0][0] and mixed["mix-b"][0][0] == alone["alone-b"][0][0]


def test_n_samples_with_a_seed_each_validate_and_repeat(engine: LLMEngine) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=200, structured_outputs={"json": ORDER})
    first, again = run(engine, {"n1": params})["n1"], run(engine, {"n2": params})["n2"]
    assert len(first) == 4 and all(json_valid(ORDER)(text) for _, text, _ in first)
    assert [ids for ids, _, _ in first] == [ids for ids, _, _ in again]  # seeded: the same again
    assert len({text for _, text, _ in first}) > 1  # and the samples differ from each other


def test_a_spec_that_does_not_compile_is_refused_and_the_engine_goes_on(engine: LLMEngine) -> None:
    for spec, words in (({"regex": "(unclosed"}, "regex does not compile"),
                        ({"grammar": "root ::= missing_rule"}, "grammar does not compile"),
                        ({"json": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}, "json"),
                        ({"json": {"type": "array", "uniqueItems": True}}, "uses uniqueItems"),
                        ({"json": {"properties": {"a": {"allOf": [{"type": "string"}]}}}}, "uses allOf")):
        with pytest.raises(GrammarError, match=re.escape(words)):
            engine.add_request("bad", "x", SamplingParams(structured_outputs=spec))
    # A property named like a keyword is a name, not the keyword.
    engine.grammars().compile({"json": {"type": "object", "properties": {"not": {"type": "integer"}}}})
    for spec, words in (({"regex": "a", "choice": ["b"]}, "exactly one"), ({"schema": {}}, "unknown"),
                        ({"choice": []}, "choice must be a list")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(structured_outputs=spec)
    assert run(engine, {"after": SamplingParams(max_tokens=5, ignore_eos=True)})["after"][0][2] == "length"


def test_a_resumed_request_continues_inside_its_grammar(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured_outputs={"json": PERSON})
    (ids, text, _), = run(engine, {"whole": params})["whole"]
    half = ids[: len(ids) // 2]
    engine.add_request("resumed", "Write it:", params, resume_token_ids=[half])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            rest += o.outputs[0].token_ids
    assert half + rest == ids  # the same seed and position: exactly the tokens of the whole run
    with pytest.raises(GrammarError, match="resumes from"):  # tokens outside the grammar are refused
        engine.add_request("off", "Write it:", params, resume_token_ids=[engine.tokenizer.encode("}}}{")])


@pytest.mark.anyio
async def test_a_deep_schema_goes_through_redis_and_a_worker(llama_ckpt: Path, redis_url: str) -> None:
    deep: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 9}
    for key in "abcdefgh":  # 8 objects deep: deeper than any job field may nest
        deep = {"type": "object", "additionalProperties": False, "required": [key], "properties": {key: deep}}
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        answer = await client.generate("x", params={"temperature": 1.0, "seed": 1, "max_tokens": 120,
                                                    "structured_outputs": {"json": deep}})
        jsonschema.validate(_loads(answer.text), deep)
        assert answer.finish_reason == "stop"
        with pytest.raises(RequestFailed) as refused:
            await client.generate("x", params={"structured_outputs": {"regex": "(unclosed"}})
        assert refused.value.code == "invalid_params" and "does not compile" in refused.value.message
        ok = await client.generate("x", params={"max_tokens": 3, "ignore_eos": True})
        assert ok.finish_reason == "length"


@pytest.mark.anyio
async def test_openai_response_format_json_schema_constrains_the_chat_answer(llama_ckpt: Path,
                                                                            redis_url: str) -> None:
    import openai
    from test_gateway import config

    from workers.gateway.server import running_gateway

    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}v1", api_key="none")
        try:
            answers = [await client.chat.completions.create(
                model=str(llama_ckpt), messages=[{"role": "user", "content": "A person, please"}],
                temperature=1.0, seed=seed, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
                for seed in range(3)]
            with pytest.raises(openai.BadRequestError, match="response_format"):
                await client.chat.completions.create(model=str(llama_ckpt), messages=[{"role": "user", "content": "x"}],
                                                     response_format={"type": "yaml"})
        finally:
            await client.close()
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(_loads(answer.choices[0].message.content), PERSON)


@pytest.mark.anyio
async def test_a_constrained_job_resumed_after_its_worker_is_killed_stays_valid(llama_ckpt: Path, redis_url: str,
                                                                               tmp_path: Path) -> None:
    """The survivor rebuilds the grammar state from the tokens already sent: the whole answer is what an
    uninterrupted run gives (seeded), and valid."""
    import redis
    from redis_worker_helpers import offline_completions, read_events, text_of, tokens_of, wait_for, worker_process
    from test_worker_crash import NAMES, collect_all, in_progress

    many = {"type": "object", "additionalProperties": False, "required": ["rows"],
            "properties": {"rows": {"type": "array", "minItems": 40, "maxItems": 60, "items": {"enum": [1, 2, 3]}}}}
    params = {"temperature": 1.0, "seed": 11, "max_tokens": 600, "structured_outputs": {"json": many}}
    (want_tokens, want_text), = offline_completions(llama_ckpt, ["rows:"], SamplingParams(**params))
    r = redis.Redis.from_url(redis_url)
    procs = {name: worker_process(llama_ckpt, redis_url, "--consumer", name, "--claim-idle", "1.5", "--grace", "5",
                                  log_path=tmp_path / f"{name}.log") for name in ("s-a", "s-b")}
    try:
        await wait_for(lambda: len(r.keys(NAMES.worker("*"))) == 2, timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            rid = await client.submit("rows:", params=params)
        victim = None
        with anyio.fail_after(30):  # 600 tokens at most: seconds of work to catch it in
            while victim is None:
                victim = next((n for n in procs if in_progress(r, redis_url, n)), None)
                await anyio.sleep(0.01)
        procs[victim].kill()
        procs[victim].wait(10)
        results = await collect_all(redis_url, [rid], timeout=60)
    finally:
        kill_all(procs)
        r.close()
    events = read_events(redis_url, rid)
    assert results[rid] == events and events[-1]["finish_reason"] == "stop"
    assert tokens_of(events) == want_tokens and text_of(events) == want_text
    jsonschema.validate(_loads(text_of(events)), many)
    survivor = next(n for n in procs if n != victim)
    assert "reclaimed job entry" in (tmp_path / f"{survivor}.log").read_text()
