"""The OpenAI-compatible API against a live stack: real redis-server, a real worker (tiny Llama), the
gateway on uvicorn, driven by the official `openai` SDK and by plain HTTP (httpx) for what the SDK
does not send (broken JSON, Last-Event-ID, disconnects)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from redis_worker_helpers import (
    NAMES,
    dead_letters,
    offline_completions,
    read_events,
    running_worker,
    text_of,
    wait_for,
)
from test_gateway import config
from test_gateway_e2e import idle

from clients import AsyncClient
from streamer import SamplingParams
from workers.gateway.server import running_gateway

GREEDY = {"max_tokens": 12, "temperature": 0.0}
LONG = 900  # tokens: seconds of work, time to disconnect and resume


def sdk(gw: Any, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "v1", api_key=key, max_retries=0, timeout=60)


async def backlog(redis_url: str) -> int:
    r = aioredis.Redis.from_url(redis_url)
    try:
        return await r.xlen(NAMES.requests)
    finally:
        await r.aclose()


def sse_lines(text: str) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event in a response body."""
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "data" in fields:
            events.append((fields.get("id"), fields["data"]))
    return events


@pytest.mark.anyio
async def test_completions_whole_and_streamed_equal_the_engine(llama_ckpt: Path, redis_url: str) -> None:
    prompts = ["The quick brown fox", "Paged attention is"]
    want = offline_completions(llama_ckpt, prompts, SamplingParams(**GREEDY, ignore_eos=True))
    model = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        whole = await client.completions.create(model=model, prompt=prompts, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert [c.text for c in whole.choices] == [text for _, text in want]
        assert [c.index for c in whole.choices] == [0, 1]
        assert {c.finish_reason for c in whole.choices} == {"length"}
        assert whole.usage.completion_tokens == 24 and whole.usage.total_tokens == whole.usage.prompt_tokens + 24
        assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == model
        texts: dict[int, str] = {0: "", 1: ""}
        usage = None
        async for chunk in await client.completions.create(
                model=model, prompt=prompts, max_tokens=12, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
            for c in chunk.choices:
                texts[c.index] += c.text
        assert [texts[0], texts[1]] == [text for _, text in want]
        assert usage is not None and usage.completion_tokens == 24
        # Token ids as the prompt: the engine's answer for those ids.
        ids = [[5, 17, 42], [9, 8]]
        by_ids = await client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                                 extra_body={"ignore_eos": True})
        want_ids = offline_completions(llama_ckpt, [{"prompt_token_ids": p} for p in ids],
                                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [c.text for c in by_ids.choices] == [text for _, text in want_ids]


@pytest.mark.anyio
async def test_chat_equals_the_redis_path_and_streams_roles_then_text(llama_ckpt: Path, redis_url: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    params = {**GREEDY, "ignore_eos": True}
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            AsyncClient(redis_url) as redis_client, sdk(gw) as client:
        rid = await redis_client.submit(messages=messages, params=params)
        redis_text = "".join([e["text"] async for e in redis_client.stream(rid, timeout=60)])
        whole = await client.chat.completions.create(model=str(llama_ckpt), messages=messages, max_tokens=12,
                                                     temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].message.content == redis_text and whole.choices[0].message.role == "assistant"
        assert whole.object == "chat.completion" and whole.usage.completion_tokens == 12
        parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, messages[1]]
        chunks = [c async for c in await client.chat.completions.create(
            model=str(llama_ckpt), messages=parts, max_completion_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == redis_text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


@pytest.mark.anyio
async def test_n_seeds_stop_strings_and_logprobs(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        msg = [{"role": "user", "content": "Tell me a story."}]
        runs = [await client.chat.completions.create(model=model, messages=msg, n=2, seed=7, temperature=1.0,
                                                     max_tokens=10, extra_body={"ignore_eos": True})
                for _ in range(2)]
        assert [c.message.content for c in runs[0].choices] == [c.message.content for c in runs[1].choices]
        assert len(runs[0].choices) == 2 and runs[0].usage.completion_tokens == 20
        # A stop string taken from the greedy answer ends it there, without the stop string.
        greedy = await client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True})
        text = greedy.choices[0].text
        stop = text[4:7]
        assert stop.strip(), text
        stopped = await client.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0,
                                                  stop=[stop], extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == text[:text.index(stop)] and stopped.choices[0].finish_reason == "stop"
        # Log-probs: the chosen token's, and 2 alternatives best first, as real probabilities.
        chat = await client.chat.completions.create(model=model, messages=msg, max_tokens=5, temperature=0,
                                                    logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert len(content) == 5 and "".join(t.token for t in content) == chat.choices[0].message.content
        for t in content:
            assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-6)  # greedy: the best one
            assert t.bytes == list(t.token.encode())
        comp = await client.completions.create(model=model, prompt="Once upon", max_tokens=4, temperature=0,
                                               logprobs=3, extra_body={"ignore_eos": True})
        lp = comp.choices[0].logprobs
        assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 4
        assert all(len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
                   for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


@pytest.mark.anyio
async def test_bad_requests_get_openai_errors_and_push_nothing(llama_ckpt: Path, redis_url: str) -> None:
    async with running_worker(llama_ckpt, redis_url), \
            running_gateway(config(redis_url, api_keys=("k1",), max_frame_bytes=4096)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", headers={"Authorization": "Bearer k1"}) as http:
        before = await backlog(redis_url)
        pushed = gw.metrics.values["requests_total"]
        model = str(llama_ckpt)
        cases: list[tuple[Any, int, str | None]] = [
            (b"{not json", 400, None),
            ({"model": model, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
            ({"model": model, "prompt": "x", "n": 1000}, 400, "n"),
            ({"model": model, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
            ({"model": model, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
            ({"model": model, "prompt": "x", "echo": True}, 400, "echo"),
            ({"model": model, "prompt": ""}, 400, "prompt"),
            ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
            ({"prompt": "x"}, 400, "model"),
            ({"model": model, "prompt": "x" * 5000}, 413, None),
            ({"model": model, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ]
        for body, status, param in cases:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post("/completions", content=data, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
            assert error["param"] == param, (body, error)
        user = [{"role": "user", "content": "x"}]
        chat_cases = [({"model": model, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
                      ({"model": model, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
                      ({"model": model, "messages": "hi"}, "messages"),
                      ({"model": model, "messages": user, "top_logprobs": 2}, "top_logprobs"),
                      ({"model": model, "messages": user, "tools": [{"type": "function"}]}, "tools")]
        for body, param in chat_cases:
            r = await http.post("/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # SDK errors: a missing key is a 401 in OpenAI's shape, an unknown model a 404.
        async with sdk(gw, key="wrong") as wrong, sdk(gw, key="k1") as right:
            with pytest.raises(openai.AuthenticationError) as denied:
                await wrong.models.list()
            assert denied.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.NotFoundError):
                await right.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
            models = await right.models.list()
        assert [m.id for m in models.data] == [model]
        assert await backlog(redis_url) == before and gw.metrics.values["requests_total"] == pushed  # none pushed


@pytest.mark.anyio
async def test_queue_full_is_429_with_retry_after(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await r.delete(NAMES.requests)
    await r.xadd(NAMES.requests, {"json": "{}"})  # one entry nobody serves: the queue is at its bound
    try:
        async with running_gateway(config(redis_url, max_queued_jobs=1)) as gw, sdk(gw) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model="m", prompt="x")
            assert refused.value.response.headers["Retry-After"] == "2"
            assert await r.xlen(NAMES.requests) == 1
    finally:
        await r.delete(NAMES.requests)
        await r.aclose()


async def _read_sse(response: httpx.Response, count: int) -> list[tuple[str | None, str]]:
    """The first `count` SSE events with data, then stop reading."""
    got: list[tuple[str | None, str]] = []
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            got += sse_lines(block + "\n\n")
            if len(got) >= count:
                return got
    return got


@pytest.mark.anyio
async def test_last_event_id_resumes_the_exact_rest(llama_ckpt: Path, redis_url: str) -> None:
    # The id holds `:`, the separator of its SSE ids `<request id>:<seq>`: positions are read after the last.
    body = {"model": str(llama_ckpt), "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url, cancel_grace_s=60)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=60) as http:
        async with http.stream("POST", "/chat/completions", json=body,
                               headers={"X-Request-Id": "resume:me", "X-Resumable-Stream": "true"}) as resp:
            assert resp.headers["x-request-id"] == "resume:me"
            first = await _read_sse(resp, 4)  # the role chunk and 3 token chunks, then the client drops
        last_id = first[-1][0]
        assert last_id is not None and last_id.startswith("resume:me:")
        # Let the worker finish meanwhile; the rest must still come, once, from the durable events.
        await wait_for(lambda: read_events(redis_url, "resume:me")[-1:] and
                       read_events(redis_url, "resume:me")[-1]["type"] == "done", 60)
        resp = await http.post("/chat/completions", json=body, headers={"Last-Event-ID": last_id})
        rest = sse_lines(resp.text)
        via_get = sse_lines((await http.get("/streams/resume:me", params={"after": last_id.rsplit(":", 1)[1]})).text)
    assert rest == via_get
    assert rest[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in first + rest[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    events = read_events(redis_url, "resume:me")
    assert text == text_of(events)
    ids = [i for i, _ in first + rest[:-1]]
    assert len(ids) == len(set(ids))  # no chunk twice
    assert chunks[-1]["usage"]["completion_tokens"] == 40 and chunks[-1]["choices"] == []
    # The final event makes two chunks (finish, usage): after the first of them only the usage follows.
    finish_id, usage_id = ids[-2], ids[-1]
    assert finish_id == usage_id + ".0"
    async with running_gateway(config(redis_url)) as gw, httpx.AsyncClient(base_url=gw.url + "v1") as http:
        tail = sse_lines((await http.get("/streams/resume:me", headers={"Last-Event-ID": finish_id})).text)
        assert tail == [(usage_id, rest[-2][1]), (None, "[DONE]")]
        gone = await http.get("/streams/never-made")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_request"


async def data_only_reader(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[list[Any], list[float]]:
    """How vLLM's benchmark client and most hand-written readers parse a stream: each message
    stripped, `data: ` removed, everything but `[DONE]` JSON. Returns the chunks and the time each
    arrived, from the request."""
    chunks, times = [], []
    start = asyncio.get_running_loop().time()
    async with http.stream("POST", path, json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for message in resp.aiter_lines():
            message = message.strip()
            if not message:
                continue
            data = message.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
            times.append(asyncio.get_running_loop().time() - start)
    return chunks, times


@pytest.mark.anyio
async def test_default_streams_are_openai_shaped_for_every_reader(llama_ckpt: Path, redis_url: str) -> None:
    """No comment and no `id:` lines unless asked for: the raw body is `data:` messages and
    `data: [DONE]` only; the SDK, a data-only reader and the resumable form carry the same text,
    and tokens arrive one by one (a first token well before the last)."""
    model = str(llama_ckpt)
    body = {"model": model, "prompt": "count", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=60) as http:
        raw = (await http.post("/completions", json=body)).text
        chunks, times = await data_only_reader(http, "/completions", body)
        via_sdk = "".join([c.choices[0].text async for c in await client.completions.create(
            model=model, prompt="count", max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True})])
        resumable = (await http.post("/completions", json=body, headers={"X-Resumable-Stream": "true"})).text
        chat, _ = await data_only_reader(http, "/chat/completions", {
            **{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": "hi"}]})
    messages = raw.split("\n\n")
    assert messages[-2:] == ["data: [DONE]", ""]
    assert all(m.startswith("data: ") and "\n" not in m for m in messages[:-1]), raw[:300]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == via_sdk
    # One message per token as it is generated, not one lump at the end (arrival times depend on the
    # machine's load, so only their order is held).
    assert len(chunks) >= 60 and len(set(times)) > 1 and times == sorted(times)
    assert resumable.startswith(": streamer\n\nid: ")
    assert [d for _, d in sse_lines(resumable)][:-1] != [] and all(i for i, _ in sse_lines(resumable)[:-1])
    assert "".join(json.loads(d)["choices"][0]["text"] for _, d in sse_lines(resumable)[:-1]) == text
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_disconnect_mid_stream_cancels_the_job_and_frees_kv(llama_ckpt: Path, redis_url: str) -> None:
    body = {"model": str(llama_ckpt), "prompt": "count", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with running_worker(llama_ckpt, redis_url) as worker, \
            running_gateway(config(redis_url, cancel_grace_s=0.2)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=60) as http:
        async with http.stream("POST", "/completions", json=body, headers={"X-Request-Id": "drop-me"}) as resp:
            await _read_sse(resp, 3)
            assert worker.engine.stats()["kv_blocks_used"] > 0
        await wait_for(lambda: idle(worker), 30)
        # A whole (non-streamed) request whose client goes away is cancelled too.
        task = asyncio.ensure_future(http.post("/completions", json={**body, "stream": False},
                                               headers={"X-Request-Id": "drop-me-too"}))
        await wait_for(lambda: worker.engine.stats()["kv_blocks_used"] > 0, 30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for(lambda: idle(worker), 30)
    for rid in ("drop-me", "drop-me-too"):
        events = read_events(redis_url, rid)
        assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "abort"
        assert events[-1]["usage"]["completion_tokens"] < LONG


@pytest.mark.anyio
async def test_shutdown_answers_whole_requests_503_and_frees_their_kv(llama_ckpt: Path, redis_url: str) -> None:
    """A whole answer cannot be resumed: a gateway shutting down says so (503, Retry-After) and cancels its job,
    while a streamed one keeps running for its client to resume elsewhere."""
    body = {"model": str(llama_ckpt), "prompt": "count", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    async with running_worker(llama_ckpt, redis_url) as worker, httpx.AsyncClient(timeout=60) as http:
        gw_cm = running_gateway(config(redis_url, cancel_grace_s=60))
        gw = await gw_cm.__aenter__()
        whole = asyncio.ensure_future(http.post(gw.url + "v1/completions", json=body,
                                                headers={"X-Request-Id": "whole-at-shutdown"}))
        await wait_for(lambda: worker.engine.stats()["kv_blocks_used"] > 0, 30)
        await gw_cm.__aexit__(None, None, None)
        resp = await whole
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "shutting_down"
        await wait_for(lambda: idle(worker), 30)
    events = read_events(redis_url, "whole-at-shutdown")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "abort"


@pytest.mark.anyio
async def test_client_mistakes_found_by_the_worker_are_400s_and_no_dead_letters(llama_ckpt: Path,
                                                                                 redis_url: str) -> None:
    """A text prompt too long for the model is only countable by the worker's tokenizer: it is pushed,
    refused by the worker, answered 400 here, and not kept in the operator's dead letters (issue 42:
    such a request used to be listed by `streamer dead`). A max_tokens past the context is refused by
    the gateway itself once a worker has announced its context."""
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=60) as http:
        model = str(llama_ckpt)
        long = await http.post("/completions", json={"model": model, "prompt": "paged attention " * 900,
                                                     "max_tokens": 4})
        assert long.status_code == 400 and long.json()["error"]["code"] == "invalid_request", long.text
        assert "prompt has" in long.json()["error"]["message"]
        await wait_for(lambda: gw.workers_max_model_len > 0, timeout=10)
        huge = await http.post("/completions", json={"model": model, "prompt": "x", "max_tokens": 10_000_000})
        assert huge.status_code == 400 and huge.json()["error"]["message"].startswith(
            "'max_tokens' or 'max_completion_tokens' is too large: 10000000. This model's maximum context length "
            f"is {gw.workers_max_model_len} tokens")
    assert dead_letters(redis_url) == []
