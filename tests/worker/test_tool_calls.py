"""Tool calls end to end (docs/structured_outputs.md): `tool_choice` required or naming a function
constrains a random-weight checkpoint (whose free output is garbage) so that every seeded sampled
answer is a call with schema-valid arguments; `auto` reads the checkpoint's own format (Hermes, Llama 3)
from what the engine really streams, `none` reads nothing; the events carry the calls and not their
text, and a job resumed after its worker is killed streams the same calls as an uninterrupted run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from redis_worker_helpers import kill_all, read_events, running_worker, text_of, tokens_of
from test_tool_messages import TEMPLATE as HERMES_TEMPLATE
from transformers import AutoTokenizer

from clients.chat_messages import merge_tool_call_deltas
from clients.errors import ProtocolError
from clients.protocol import Job, decode_job, encode_job
from clients.redis_client import AsyncClient, RequestFailed
from streamer import EngineConfig, LLMEngine, SamplingParams
from workers.worker.tool_calls import NO_PARAMETERS, ToolCalls, call_id, sampling_params
from workers.worker.tool_parsers import JsonArrayToolParser, NamedToolParser

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"enum": ["Oslo", "Paris", "Lima"]}, "unit": {"enum": ["C", "F"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"], "properties": {
    "query": {"type": "string", "minLength": 1, "maxLength": 12},
    "limit": {"type": "integer", "minimum": 1, "maximum": 10}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": SEARCH}},
         {"type": "function", "function": {"name": "now", "description": "The time (no parameters)"}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "now": NO_PARAMETERS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
SEARCH_CHOICE = {"type": "function", "function": {"name": "search"}}
# Output forced into each family's format (structured_outputs, which tool_choice auto leaves alone):
# the parser then reads what the engine really streams, token boundaries and all.
HERMES_OUT = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Paris|Lima)", '
              r'"unit": "(C|F)"\}\}\n</tool_call>')
LLAMA3_OUT = r'\{"name": "search", "parameters": \{"query": "[a-z]{1,8}"\}\}; \{"name": "now", "parameters": \{\}\}'
LLAMA3_TEMPLATE = ("{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n{% for t in tools %}{{ t | tojson }}"
                   "{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}"
                   "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def job_of(tool_choice: Any = None, **params: Any) -> Job:
    job = {"id": "j", "messages": MESSAGES, "tools": TOOLS, "params": params}
    return decode_job(encode_job(job if tool_choice is None else {**job, "tool_choice": tool_choice}))


def loads(text: str) -> Any:
    try:
        return json.loads(text, strict=False)  # a raw control character passes xgrammar's JSON grammar
    except ValueError:
        return None


def valid_calls(calls: list[dict[str, Any]]) -> bool:
    """At least one call, each to one of the tools with arguments valid against its schema."""
    try:
        for call in calls:
            jsonschema.validate(loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    except (KeyError, jsonschema.ValidationError):
        return False
    return bool(calls)


def with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def engine(llama_ckpt: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=1024, max_num_seqs=64))


@pytest.fixture(scope="module")
def hermes_ckpt(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(llama_ckpt, tmp_path_factory.mktemp("hermes") / "ckpt", HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def llama3_ckpt(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(llama_ckpt, tmp_path_factory.mktemp("llama3") / "ckpt", LLAMA3_TEMPLATE)


def run_jobs(engine: LLMEngine, jobs: dict[str, Job]) -> dict[str, tuple[str, list[dict[str, Any]], str]]:
    """Each job's sample 0 as the worker would send it: (content, calls, finish reason)."""
    parsers = {rid: ToolCalls.for_job(job, None) for rid, job in jobs.items()}
    for rid, job in jobs.items():
        params = SamplingParams.from_dict(sampling_params(job))
        engine.add_request(rid, engine.render_chat(job.messages, job.tools), params)
    out: dict[str, tuple[str, list[dict[str, Any]], str]] = {rid: ("", [], "") for rid in jobs}
    while engine.has_unfinished_requests():
        for o in engine.step():
            c, tools = o.outputs[0], parsers[o.request_id]
            content, calls, reason = out[o.request_id]
            text, deltas = (c.text, []) if tools is None else tools.feed(0, c.text, c.finish_reason is not None)
            merge_tool_call_deltas(calls, deltas)
            if c.finish_reason is not None:
                reason = c.finish_reason if tools is None else tools.finish_reason(0, c.finish_reason)
            out[o.request_id] = (content + text, calls, reason)
    return out


def test_required_makes_every_sampled_answer_a_valid_call(engine: LLMEngine) -> None:
    required = {f"req-{i}": job_of("required", temperature=1.0, seed=i, max_tokens=1000) for i in range(50)}
    free = {f"free-{i}": job_of("none", temperature=1.0, seed=i, max_tokens=60) for i in range(10)}
    results = run_jobs(engine, {**required, **free})
    for rid in required:
        content, calls, reason = results[rid]
        assert reason == "tool_calls" and content == "" and valid_calls(calls), (rid, results[rid])
    names = {call["function"]["name"] for rid in required for call in results[rid][1]}
    assert names == set(SCHEMAS)  # each tool is chosen by some answer
    # The same requests unconstrained: their text is no such call (so the check above can fail).
    parsed = [JsonArrayToolParser().parse(results[rid][0]) for rid in free]
    assert not any(valid_calls([{"function": {"name": c.name, "arguments": c.arguments}} for c in p.tool_calls])
                   for p in parsed)


def test_a_named_function_makes_every_answer_its_arguments(engine: LLMEngine) -> None:
    named = {f"named-{i}": job_of(SEARCH_CHOICE, temperature=1.0, seed=i, max_tokens=400) for i in range(50)}
    free = {f"named-free-{i}": job_of("none", temperature=1.0, seed=i, max_tokens=60) for i in range(10)}
    results = run_jobs(engine, {**named, **free})
    for rid in named:
        content, calls, reason = results[rid]
        # As OpenAI ends a forced call: `stop`, not `tool_calls`.
        assert reason == "stop" and content == "" and len(calls) == 1, (rid, results[rid])
        assert calls[0]["function"]["name"] == "search" and valid_calls(calls), (rid, results[rid])
    unconstrained = [NamedToolParser("search").parse(results[rid][0]).tool_calls[0] for rid in free]
    assert not any(valid_calls([{"function": {"name": c.name, "arguments": c.arguments}}]) for c in unconstrained)


def calls_of(events: list[dict[str, Any]], index: int = 0) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    for e in events:
        if e["index"] == index and e.get("tool_calls"):
            merge_tool_call_deltas(calls, e["tool_calls"])
    return calls


def raw_text(ckpt: Path, events: list[dict[str, Any]], index: int = 0) -> str:
    return AutoTokenizer.from_pretrained(ckpt).decode(tokens_of(events, index), skip_special_tokens=True)


@pytest.mark.anyio
async def test_auto_reads_hermes_calls_from_the_stream_and_none_reads_nothing(hermes_ckpt: Path,
                                                                             redis_url: str) -> None:
    params = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 150, "structured_outputs": {"regex": HERMES_OUT}}
    async with running_worker(hermes_ckpt, redis_url), AsyncClient(redis_url) as client:
        rid = await client.submit(messages=MESSAGES, tools=TOOLS, params=params)  # auto: the default
        none = await client.submit(messages=MESSAGES, tools=TOOLS, tool_choice="none", params=params)
        answer = await client.generate(messages=MESSAGES, tools=TOOLS, params=params)
        with anyio.fail_after(60):
            events = [e async for e in client.stream(rid)]
            none_events = [e async for e in client.stream(none)]
    assert events[-1]["finish_reasons"] == ["tool_calls", "tool_calls"] and events[-1]["finish_reason"] == "tool_calls"
    for sample in (0, 1):
        calls = calls_of(events, sample)
        raw = raw_text(hermes_ckpt, events, sample)
        assert re.fullmatch(HERMES_OUT, raw) and text_of(events, sample) == "Sure.\n"  # the call is not in `text`
        assert [c["id"] for c in calls] == [call_id(rid, sample, 0)] and valid_calls(calls)
        assert json.loads(calls[0]["function"]["arguments"]) == json.loads(raw.split("\n")[2])["arguments"]
    assert answer.tool_calls[0][0]["function"]["name"] == "get_weather" and answer.text == "Sure.\n"
    # none: the same output stays text
    assert not any("tool_calls" in e for e in none_events) and none_events[-1]["finish_reasons"] == ["stop", "stop"]
    assert re.fullmatch(HERMES_OUT, text_of(none_events)) and text_of(none_events) == raw_text(hermes_ckpt, none_events)


@pytest.mark.anyio
async def test_auto_reads_llama3_calls_and_an_unknown_template_only_with_the_override(
        llama3_ckpt: Path, llama_ckpt: Path, redis_url: str) -> None:
    params = {"temperature": 1.0, "seed": 2, "max_tokens": 150, "structured_outputs": {"regex": LLAMA3_OUT}}
    async with running_worker(llama3_ckpt, redis_url), AsyncClient(redis_url) as client:
        llama3 = await client.generate(messages=MESSAGES, tools=TOOLS, params=params)
    calls = llama3.tool_calls[0]
    assert [c["function"]["name"] for c in calls] == ["search", "now"] and valid_calls(calls)
    assert llama3.text == "" and llama3.finish_reason == "tool_calls"
    hermes = {**params, "structured_outputs": {"regex": HERMES_OUT}}
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        unknown = await client.generate(messages=MESSAGES, tools=TOOLS, params=hermes)  # its template: no format
    assert re.fullmatch(HERMES_OUT, unknown.text) and not unknown.tool_calls and unknown.finish_reason == "stop"
    async with running_worker(llama_ckpt, redis_url, tool_call_parser="hermes"), AsyncClient(redis_url) as client:
        told = await client.generate(messages=MESSAGES, tools=TOOLS, params=hermes)
    assert told.text == "Sure.\n" and told.tool_calls[0][0]["function"]["name"] == "get_weather"


@pytest.mark.anyio
async def test_required_and_named_through_a_worker(hermes_ckpt: Path, redis_url: str) -> None:
    params = {"temperature": 1.0, "max_tokens": 1000}
    async with running_worker(hermes_ckpt, redis_url), AsyncClient(redis_url) as client:
        required = [await client.generate(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          params={**params, "seed": s}) for s in range(3)]
        named = await client.generate(messages=MESSAGES, tools=TOOLS, tool_choice=SEARCH_CHOICE,
                                      params={**params, "seed": 1})
        with pytest.raises(RequestFailed) as both:
            await client.generate(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                  params={"structured_outputs": {"regex": "a"}})
    for answer in [*required, named]:
        assert answer.finish_reason == ("stop" if answer is named else "tool_calls")
        assert answer.text == "" and valid_calls(answer.tool_calls[0])
        events = read_events(redis_url, answer.id)
        assert all(e["text"] == "" for e in events)  # all of it went out as calls
    assert [c["function"]["name"] for c in named.tool_calls[0]] == ["search"]
    assert both.value.code == "invalid_params" and "structured_outputs" in both.value.message


@pytest.mark.anyio
async def test_a_tool_call_job_resumed_after_its_worker_is_killed_streams_the_same_calls(
        llama_ckpt: Path, redis_url: str, tmp_path: Path) -> None:
    """The survivor rebuilds each parser from the text already sent: the calls, their ids and the
    content are those of an uninterrupted run (seeded), and no argument text is lost or repeated."""
    import redis
    from redis_worker_helpers import offline_completions, wait_for, worker_process
    from test_worker_crash import NAMES, collect_all, in_progress

    rows = {"type": "object", "additionalProperties": False, "required": ["rows"], "properties": {
        "rows": {"type": "array", "minItems": 40, "maxItems": 60, "items": {"enum": [1, 2, 3]}}}}
    tools = [{"type": "function", "function": {"name": "fill", "parameters": rows}}]
    payload = {"messages": MESSAGES, "tools": tools, "tool_choice": "required",
               "params": {"temperature": 1.0, "seed": 11, "max_tokens": 800}}
    job = decode_job(encode_job({"id": "resumed", **payload}))
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    prompt = tok(tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False).input_ids
    params = SamplingParams.from_dict(sampling_params(job))
    (want_tokens, want_text), = offline_completions(llama_ckpt, [prompt], params)
    want = ToolCalls(job, None)
    want_content, want_deltas = want.feed(0, want_text, True)
    want_calls: list[dict[str, Any]] = []
    merge_tool_call_deltas(want_calls, want_deltas)
    r = redis.Redis.from_url(redis_url)
    procs = {name: worker_process(llama_ckpt, redis_url, "--consumer", name, "--claim-idle", "1.5", "--grace", "5",
                                  log_path=tmp_path / f"{name}.log") for name in ("t-a", "t-b")}
    try:
        await wait_for(lambda: len(r.keys(NAMES.worker("*"))) == 2, timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            rid = await client.submit(id="resumed", **payload)
        victim = None
        with anyio.fail_after(30):
            while victim is None:
                victim = next((n for n in procs if in_progress(r, redis_url, n)), None)
                await anyio.sleep(0.01)
        procs[victim].kill()
        procs[victim].wait(10)
        await collect_all(redis_url, [rid], timeout=60)
    finally:
        kill_all(procs)
        r.close()
    events = read_events(redis_url, rid)
    survivor = next(n for n in procs if n != victim)
    assert "reclaimed job entry" in (tmp_path / f"{survivor}.log").read_text()
    assert tokens_of(events) == want_tokens
    assert events[-1]["finish_reasons"] == ["tool_calls"]
    assert text_of(events) == want_content == ""
    assert calls_of(events) == want_calls
    assert want_calls[0]["id"] == call_id("resumed", 0, 0)
    for call in want_calls:
        jsonschema.validate(loads(call["function"]["arguments"]), rows)


@pytest.mark.anyio
async def test_openai_sdk_gets_tool_calls_whole_and_streamed(hermes_ckpt: Path, redis_url: str) -> None:
    import openai
    from test_gateway import config

    from workers.gateway.server import running_gateway

    ask = {"model": str(hermes_ckpt), "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
           "temperature": 1.0, "seed": 3, "max_tokens": 1000}
    async with running_worker(hermes_ckpt, redis_url), running_gateway(config(redis_url)) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}v1", api_key="none")
        try:
            whole = await client.chat.completions.create(**ask)
            chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
            named = await client.chat.completions.create(**{**ask, "tool_choice": SEARCH_CHOICE, "n": 2})
            call = whole.choices[0].message.tool_calls[0]
            # The next turn carries the call and its result back, as an agent loop does.
            turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "-3 C"}]
            follow_up = await client.chat.completions.create(**{**ask, "messages": turn, "tool_choice": "none",
                                                                 "max_tokens": 4})
            with pytest.raises(openai.BadRequestError, match="not in `tools`"):
                await client.chat.completions.create(**{**ask, "tool_choice": {"type": "function",
                                                                               "function": {"name": "nope"}}})
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                await client.chat.completions.create(**{**ask, "tools": None})
        finally:
            await client.close()
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [c.model_dump() for c in choice.message.tool_calls]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls) and valid_calls(calls)
    # Streamed: delta.tool_calls accumulated by index give the same calls (the same seed).
    streamed: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                streamed[delta.index] = {"id": delta.id, "type": delta.type,
                                         "function": {"name": delta.function.name, "arguments": ""}}
            streamed[delta.index]["function"]["arguments"] += delta.function.arguments or ""
    without_ids = [{k: v for k, v in c.items() if k != "id"} for c in calls]
    assert [{"type": c["type"], "function": c["function"]} for _, c in sorted(streamed.items())] == without_ids
    assert all(c["id"].startswith("call_") for c in streamed.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    for choice in named.choices:
        assert choice.finish_reason == "stop"  # a forced call ends as OpenAI ends it
        assert [c.function.name for c in choice.message.tool_calls] == ["search"]
        assert valid_calls([c.model_dump() for c in choice.message.tool_calls])
    assert follow_up.choices[0].finish_reason in ("stop", "length") and not follow_up.choices[0].message.tool_calls


# Root-relative references, as Pydantic writes them: `#` is the tool's own schema.
BOOK = {"type": "object", "additionalProperties": False, "required": ["start", "end"],
        "properties": {"start": {"$ref": "#/$defs/City"}, "end": {"$ref": "#/properties/start"}},
        "$defs": {"City": {"enum": ["Oslo", "Lima"]}}}


def test_required_follows_each_tools_root_relative_refs(engine: LLMEngine) -> None:
    tools = [TOOLS[0], {"type": "function", "function": {"name": "book", "parameters": BOOK}}]
    jobs = {f"ref-{i}": decode_job(encode_job({"id": f"ref-{i}", "messages": MESSAGES, "tools": tools,
                                               "tool_choice": "required",
                                               "params": {"temperature": 1.0, "seed": i, "max_tokens": 600}}))
            for i in range(20)}
    results = run_jobs(engine, jobs)
    schemas = {"get_weather": WEATHER, "book": BOOK}
    for rid, (content, calls, reason) in results.items():
        assert reason == "tool_calls" and content == "" and calls, (rid, results[rid])
        for call in calls:  # valid against the tool's own schema, its refs read from its own root
            jsonschema.validate(loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    assert "book" in {call["function"]["name"] for _, calls, _ in results.values() for call in calls}


def test_a_required_answer_cut_by_max_tokens_is_calls_or_nothing_never_content(engine: LLMEngine) -> None:
    results = run_jobs(engine, {f"cut-{n}": job_of("required", temperature=1.0, seed=n, max_tokens=n)
                                for n in range(1, 30)})
    for rid, (content, calls, reason) in results.items():
        # A cut call keeps its arguments so far; a call cut before its name is not one.
        assert content == "" and reason == "length", (rid, results[rid])
        assert all(call["function"]["name"] in SCHEMAS for call in calls), (rid, results[rid])


@pytest.mark.parametrize("names, words", [
    (["get weather"], "must be 1 to 64 letters"), (["x" * 65], "must be 1 to 64 letters"), ([""], "1 to 64"),
    (["wetter.heute"], "letters, digits"), (["f", "g", "f"], "two tools are named 'f'")])
def test_tool_names_are_openai_names_and_each_is_given_once(names: list[str], words: str) -> None:
    def job(tool_names: list[str]) -> dict[str, Any]:
        tools = [{"type": "function", "function": {"name": name}} for name in tool_names]
        return {"id": "n", "messages": MESSAGES, "tools": tools}

    with pytest.raises(ProtocolError, match=re.escape(words)) as refused:
        decode_job(encode_job(job(names)))
    assert refused.value.code == "invalid_request"
    assert decode_job(encode_job(job(["a" * 64, "get_weather-2"]))).tools is not None  # the bounds themselves pass


def test_an_answers_own_arguments_come_back_with_the_next_turn_even_with_a_raw_control_character() -> None:
    """xgrammar's JSON lets a string hold a raw tab or newline; an agent sends the call back as it got it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "a\tb"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "nothing found"}]
    job = decode_job(encode_job({"id": "t", "messages": messages, "tools": TOOLS}))
    assert job.messages[1]["tool_calls"][0]["function"]["arguments"] == {"query": "a\tb"}
