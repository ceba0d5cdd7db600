"""The Responses API (`/v1/responses`) against a live stack: a real redis-server, a real worker (tiny
Llama), gateways on uvicorn, driven by the official `openai` SDK as a user calls it. The faults (a
worker SIGKILLed, gateway and Redis restarts) are in test_responses_faults.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import redis.asyncio as aioredis
from docs_examples import run_docs_example
from redis_worker_helpers import NAMES, long_context_checkpoint, running_worker
from test_batches import until
from test_gateway import config
from test_openai_api import sdk

from clients.protocol import event_stream_id
from workers.gateway.hub import Hub
from workers.gateway.keys_file import TenantLimits
from workers.gateway.metrics import Metrics
from workers.gateway.openai.response_store import ResponseStore, StoredResponse
from workers.gateway.server import running_gateway

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"enum": ["Oslo", "Paris", "Lima"]}, "unit": {"enum": ["C", "F"]}}}


async def events_of(stream: Any) -> list[Any]:
    async with stream:
        return [event async for event in stream]


def numbered(events: list[Any], start: int = 0) -> None:
    """Sequence numbers from `start`, each once, none missing."""
    assert [e.sequence_number for e in events] == list(range(start, start + len(events)))


@pytest.mark.anyio
async def test_whole_streamed_and_background_responses(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        whole = await client.responses.create(model=model, input="Tell me about foxes.", instructions="Be brief.",
                                              max_output_tokens=8, **GREEDY)
        assert whole.object == "response" and whole.status == "incomplete" and whole.id.startswith("resp_")
        assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage is not None and whole.usage.output_tokens == 8 and whole.instructions == "Be brief."
        # The same conversation through the chat endpoint: the same answer.
        chat = await client.chat.completions.create(
            model=model, max_tokens=8, messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Tell me about foxes."}], **GREEDY)
        assert whole.output_text == chat.choices[0].message.content and whole.output_text
        assert whole.usage.input_tokens == chat.usage.prompt_tokens

        # Streamed: OpenAI's event types in order, numbered 0, 1, 2 ..., the deltas making the text.
        events = await events_of(await client.responses.create(
            model=model, input=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "input_text", "text": "Tell me about foxes."}]}],
            max_output_tokens=8, stream=True, **GREEDY))
        numbered(events)
        kinds = [e.type for e in events]
        deltas = kinds.count("response.output_text.delta")
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *["response.output_text.delta"] * deltas,
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.incomplete"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
        assert events[-1].response.output_text == whole.output_text and events[0].response.status == "in_progress"

        # Background: answered at once, queued; retrieve follows it to its end from any position.
        queued = await client.responses.create(model=model, input="Tell me about foxes.", instructions="Be brief.",
                                               max_output_tokens=8, background=True, **GREEDY)
        assert queued.status == "queued" and queued.background and queued.output == []
        await until(lambda: _ended(client, queued.id), timeout=60)
        done = await client.responses.retrieve(queued.id)
        assert done.status == "incomplete" and done.output_text == whole.output_text
        assert (await client.responses.cancel(queued.id)).status == "incomplete"  # ended already: unchanged
        replayed = await events_of(await client.responses.retrieve(queued.id, stream=True))
        numbered(replayed)
        assert replayed[0].response.status == "queued" and replayed[1].type == "response.queued"
        assert replayed[2].type == "response.in_progress"
        rest = await events_of(await client.responses.retrieve(queued.id, stream=True, starting_after=5))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in replayed[6:]]

        # Stored unless store=false; deleted, it is gone.
        unstored = await client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        deleted = await _delete(client, queued.id)
        assert deleted == {"id": queued.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(queued.id)
        with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
            await client.responses.cancel(whole.id)


async def plain_sse(http: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> list[dict[str, Any]]:
    """The Responses stream as a hand-written reader takes it, no SDK: the raw body line by line, each
    event an `event: TYPE` line, a `data: JSON` line of that type and a blank line, and nothing else
    (no comment, no `id:`, no `[DONE]`: the body ends after the last event)."""
    async with http.stream(method, path, **kwargs) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in resp.aiter_lines()]
    assert lines and len(lines) % 3 == 0, lines[-4:]
    events = []
    for kind, data, blank in zip(lines[0::3], lines[1::3], lines[2::3], strict=True):
        assert kind.startswith("event: ") and data.startswith("data: ") and blank == "", (kind, data, blank)
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == kind.removeprefix("event: ")
        events.append(event)
    return events


@pytest.mark.anyio
async def test_a_plain_line_reader_reads_what_the_sdk_reads(llama_ckpt: Path, redis_url: str) -> None:
    """`/v1/responses` with `stream: true` read line by line over plain HTTP: every event parses, the
    sequence numbers run 0, 1, 2 ... and the stream ends with the response's final event, where the
    `openai` SDK's iteration ends; the SDK reads the same events of the same request. Resumed with
    `GET ...?stream=true&starting_after=N`, the same reader gets the same events after N."""
    model = str(llama_ckpt)
    asked = {"model": model, "input": "Tell me about foxes.", "max_output_tokens": 8, "temperature": 0}
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=60) as http:
        plain = await plain_sse(http, "POST", "/responses", json={**asked, "stream": True, "ignore_eos": True})
        via_sdk = await events_of(await client.responses.create(**asked, stream=True,
                                                                extra_body={"ignore_eos": True}))
        response_id = plain[0]["response"]["id"]
        resumed = await plain_sse(http, "GET", f"/responses/{response_id}",
                                  params={"stream": "true", "starting_after": "3"})
    assert [e["sequence_number"] for e in plain] == list(range(len(plain)))
    assert plain[-1]["type"] == "response.incomplete" and plain[-1]["response"]["status"] == "incomplete"
    assert [(e.type, e.sequence_number) for e in via_sdk] == [(e["type"], e["sequence_number"]) for e in plain]
    deltas = ["".join(e["delta"] for e in plain if e["type"] == "response.output_text.delta"),
              "".join(e.delta for e in via_sdk if e.type == "response.output_text.delta")]
    assert deltas[0] and deltas[0] == deltas[1] == via_sdk[-1].response.output_text
    assert resumed == plain[4:]


@pytest.mark.anyio
async def test_reading_a_running_response_again_replays_only_its_new_events(redis_url: str) -> None:
    """`GET /v1/responses/{id}` of a running response (ResponseStore.current): each read asks Redis only
    for the job events written after those the previous read saw (Redis's own log of the XRANGEs it
    answered), and answers what replaying every event answers (a store that kept nothing). Events lost
    with Redis are noticed, and what is left is replayed."""
    hub = Hub(redis_url, NAMES, Metrics())
    r = aioredis.Redis.from_url(redis_url)
    fixed = {"id": "resp_kept", "object": "response", "model": "m", "background": True, "created_at": 1}
    stored = StoredResponse("resp_kept", fixed, "kept-job", "", "", [])
    store, key = ResponseStore(hub), NAMES.events("kept-job")
    job = [{"type": "token", "seq": 0, "text": "Once"}, {"type": "token", "seq": 1, "text": " upon"},
           {"type": "token", "seq": 2, "text": " a"},
           {"type": "done", "seq": 3, "finish_reason": "length", "usage": {"prompt_tokens": 2, "completion_tokens": 3}}]

    async def write(event: dict[str, Any]) -> None:
        await r.xadd(key, {"json": json.dumps(event)}, id=event_stream_id(event["seq"]))

    async def read() -> tuple[dict[str, Any], list[str]]:
        """The kept store's answer, and where each XRANGE of the events it sent started."""
        await r.slowlog_reset()
        got = await store.current(stored)
        sent = [e["command"].decode().split() for e in await r.slowlog_get(128)]
        return got, [c[2] for c in reversed(sent) if c[:2] == ["XRANGE", key]]

    threshold = (await r.config_get("slowlog-log-slower-than"))["slowlog-log-slower-than"]
    try:
        await r.config_set("slowlog-log-slower-than", 0)  # every command, with its arguments
        await store.create(stored)
        await r.set(NAMES.job("kept-job"), "0-1")  # its job is pushed
        queued, starts = await read()
        assert queued["status"] == "queued" and starts == ["(0-0"]
        for event in job[:3]:
            await write(event)
            got, starts = await read()
            assert starts == [f"({event_stream_id(event['seq'] - 1) if event['seq'] else '0-0'}"]
            assert got == await ResponseStore(hub).current(stored) and got["status"] == "in_progress"
        assert got["output"][0]["content"][0]["text"] == "Once upon a"
        # Redis restarted without the last two events: replayed from what it holds.
        await r.delete(key)
        await write(job[0])
        got, starts = await read()
        assert starts == ["(0-3", "(0-0"] and got == await ResponseStore(hub).current(stored)
        assert got["output"][0]["content"][0]["text"] == "Once"
        for event in job[1:]:
            await write(event)
        final = await store.current(stored)
        assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Once upon a"
        assert final == (await store.load("resp_kept")).final  # type: ignore[union-attr]
    finally:
        await r.config_set("slowlog-log-slower-than", threshold)
        await r.aclose()
        await hub.redis.aclose()


async def _ended(client: openai.AsyncOpenAI, response_id: str) -> bool:
    return (await client.responses.retrieve(response_id)).status not in ("queued", "in_progress")


async def _delete(client: openai.AsyncOpenAI, response_id: str) -> dict[str, Any]:
    """DELETE /v1/responses/{id} (the SDK's `delete` returns None: the body is what OpenAI documents)."""
    reply = await client.delete(f"/responses/{response_id}", cast_to=object)
    assert isinstance(reply, dict)
    return reply


@pytest.mark.anyio
async def test_json_schema_format_and_function_calls(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
        shaped = await client.responses.create(model=model, input="Weather?", text={"format": fmt},
                                               max_output_tokens=200, temperature=1.0, extra_body={"seed": 3})
        assert shaped.status == "completed" and shaped.text.format.type == "json_schema"
        jsonschema.validate(json.loads(shaped.output_text), WEATHER)

        tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
        events = await events_of(await client.responses.create(
            model=model, input="Weather in Oslo?", tools=tools, tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200, temperature=1.0, stream=True, extra_body={"seed": 1}))
        numbered(events)
        end = events[-1].response
        assert events[-1].type == "response.completed" and [o.type for o in end.output] == ["function_call"]
        call = end.output[0]
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
        assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]

        # The call's result goes back as a function_call_output item of the next turn.
        follow = await client.responses.create(model=model, previous_response_id=end.id, max_output_tokens=4,
                                               input=[{"type": "function_call_output", "call_id": call.call_id,
                                                       "output": "12 C, sunny"}], **GREEDY)
        assert follow.status == "incomplete" and follow.previous_response_id == end.id and follow.output_text


@pytest.mark.anyio
async def test_previous_response_id_continues_on_the_cached_prefix(llama_ckpt: Path, redis_url: str) -> None:
    """The follow-up's prompt is the first turn's prompt, answer and the new input: the prefix cache
    serves the first turn's full blocks (the conversation's session keeps it on the same worker)."""
    model = str(llama_ckpt)
    question = "Redis streams carry jobs from clients in any language to workers, and tokens flow back. " * 3
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        first = await client.responses.create(model=model, input=question, max_output_tokens=16, **GREEDY)
        second = await client.responses.create(model=model, previous_response_id=first.id, input="And then?",
                                               max_output_tokens=8, **GREEDY)
        assert first.usage is not None and second.usage is not None and first.usage.input_tokens >= 48
        cached = second.usage.input_tokens_details.cached_tokens
        # Every full 16-token block of the first prompt (its last token may merge with the answer's text).
        assert cached >= (first.usage.input_tokens - 1) // 16 * 16, (cached, first.usage)
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        # The stored conversation is exactly the items sent in full.
        spelled = await client.responses.create(model=model, max_output_tokens=8, **GREEDY, input=[
            {"role": "user", "content": question}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}])
        assert spelled.output_text == second.output_text
        third = await client.responses.create(model=model, previous_response_id=second.id, input="Why?",
                                              max_output_tokens=4, **GREEDY)
        assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=model, previous_response_id="resp_nope", input="x")


@pytest.mark.anyio
async def test_cancel_ends_a_background_response_cancelled(tmp_path: Path, redis_url: str) -> None:
    ckpt = long_context_checkpoint(tmp_path / "long")
    async with running_worker(ckpt, redis_url, engine={"num_kv_blocks": 1100}), \
            running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        started = await client.responses.create(model=str(ckpt), input="Count.", max_output_tokens=8000,
                                                background=True, **GREEDY)
        await until(lambda: _has_output(client, started.id), timeout=60)
        cancelled = await client.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        await until(lambda: _stored_final(client, started.id), timeout=30)
        end = await client.responses.retrieve(started.id)
        assert end.status == "cancelled" and end.usage is not None and 0 < end.usage.output_tokens < 8000
        events = await events_of(await client.responses.retrieve(started.id, stream=True))
        numbered(events)
        # (an event type this SDK has no class for: its `response` stays a dict)
        assert events[-1].type == "response.cancelled" and events[-1].model_dump()["response"]["status"] == "cancelled"


async def _stored_final(client: openai.AsyncOpenAI, response_id: str) -> bool:
    """Its job ended (a cancelled one reads `cancelled` at once, but has its usage only then)."""
    return (await client.responses.retrieve(response_id)).usage is not None


async def _has_output(client: openai.AsyncOpenAI, response_id: str) -> bool:
    return bool((await client.responses.retrieve(response_id)).output_text)


@pytest.mark.anyio
async def test_bad_requests_and_other_tenants(redis_url: str) -> None:
    """Refused before anything is pushed, naming the field as a Responses client calls it; another
    tenant's key does not see a response (no worker: the jobs wait in the queue)."""
    cfg = config(redis_url, tenants={"acme": TenantLimits(), "beta": TenantLimits()},
                 key_tenants={"ka": "acme", "kb": "beta"})
    async with running_gateway(cfg) as gw, sdk(gw, "ka") as acme, sdk(gw, "kb") as beta:
        cases = [({"input": "x", "frobnicate": 1}, "frobnicate"), ({}, "input"),
                 ({"input": "x", "background": True, "store": False}, "store"),
                 ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                 ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
                 ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                  "input[0].content"),
                 ({"input": [{"type": "web_search_call"}]}, "input[0].type")]
        for body, param in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                await acme.responses.create(model="m", extra_body=body)
            assert refused.value.body["param"] == param, (body, refused.value.body)
        queued = await acme.responses.create(model="m", input="x", background=True)
        assert (await acme.responses.retrieve(queued.id)).status == "queued"
        with pytest.raises(openai.NotFoundError):
            await beta.responses.retrieve(queued.id)
        with pytest.raises(openai.NotFoundError):
            await beta.responses.create(model="m", input="x", previous_response_id=queued.id)
        with pytest.raises(openai.BadRequestError):  # not finished: no follow-up yet
            await acme.responses.create(model="m", input="x", previous_response_id=queued.id)
        # Its job's keys gone (expired, or lost with Redis) before it ran: the response ends failed, and
        # the gateway's sweeper stores that by itself.
        r = aioredis.Redis.from_url(redis_url)
        try:
            await r.delete(NAMES.job(f"acme/{queued.id}"))
            await until(lambda: _has_final(r, queued.id), timeout=10)
        finally:
            await r.aclose()
        failed = await acme.responses.retrieve(queued.id)
        assert failed.status == "failed" and failed.error is not None and failed.error.code == "expired"


async def _has_final(r: aioredis.Redis, response_id: str) -> bool:
    return bool(await r.hexists(f"{NAMES.prefix}:response:{response_id}", "final"))


@pytest.mark.anyio
async def test_the_docs_example_runs_as_written(llama_ckpt: Path, redis_url: str) -> None:
    """docs/openai.md's Responses API example, with only the gateway's address changed."""
    printed = (await run_docs_example("## Responses API", llama_ckpt, redis_url)).splitlines()
    assert "background: queued" in printed and printed[-1] in ("status: completed", "status: incomplete"), printed
    assert any(line.startswith("cached prompt tokens: ") for line in printed), printed
