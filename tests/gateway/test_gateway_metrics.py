"""The gateway's Prometheus metrics, read back from its real `/metrics` page: a real redis-server, the
gateway on uvicorn, real WebSockets and OpenAI API streams (httpx), with the worker's side played by the
test (test_gateway.py's `emit`). Time to first token is counted once per request whose first token
reached its client, per protocol; the open connection gauges follow sockets and streams up and down."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from test_gateway import collect, config, done, emit, http_get, recv, send, tokens, wait_jobs
from websockets.asyncio.client import connect

from clients.events import error_event
from workers.gateway.metrics import PREFIX, TTFT_BUCKETS
from workers.gateway.server import running_gateway

TTFT = PREFIX + "time_to_first_token_seconds"
OPEN = PREFIX + "open_connections"
# Every name the gateway had before prometheus_client, same meaning: dashboards and alerts keep working.
OLD_NAMES = ["connections_open", "connections_total", "connections_refused_total", "requests_inflight",
             "requests_total", "resumes_total", "cancels_total", "grace_cancels_total", "events_relayed_total",
             "stream_fills_total", "slow_consumer_closes_total", "redis_errors_total", "errors_total"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(gw: Any, accept: str | None = None) -> tuple[str, str]:
    status, headers, body = await http_get(gw.url + "metrics", {"Accept": accept} if accept else {})
    assert status == 200
    return headers["Content-Type"], body.decode()


async def samples(gw: Any) -> Samples:
    """Every sample on the page, parsed by prometheus_client's own parser (so the page is valid)."""
    _, text = await scrape(gw)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def ttft(page: Samples, protocol: str, part: str = "count", le: str | None = None) -> float:
    labels = {"protocol": protocol} | ({"le": le} if le else {})
    return page[(f"{TTFT}_{part}", tuple(sorted(labels.items())))]


def open_now(page: Samples, protocol: str) -> float:
    return page[(OPEN, (("protocol", protocol),))]


async def until(gw: Any, check: Callable[[Samples], bool], timeout: float = 10.0) -> Samples:
    """The page once `check` holds on it (a closed socket or stream is noticed a moment later)."""
    async def poll() -> Samples:
        while not check(page := await samples(gw)):
            await asyncio.sleep(0.05)
        return page

    return await asyncio.wait_for(poll(), timeout)


def chat(stream: bool = True) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def read_sse(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of a stream, up to and with `[DONE]`."""
    out = []
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            out.append(line[6:])
            if out[-1] == "[DONE]":
                return out
    return out


@pytest.mark.anyio
async def test_time_to_first_token_counts_each_request_whose_first_token_was_relayed(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=30) as http:
        page = await samples(gw)
        assert ttft(page, "ws") == 0 and ttft(page, "openai") == 0  # both series exist from the start
        # --- WebSocket: `slow` waits 0.3 s for its first token, `fast` gets three at once, `failed`
        # ends in an error before any token: two first tokens relayed.
        async with connect(gw.ws_url) as ws:
            for rid in ("slow", "fast", "failed"):
                await send(ws, {"type": "generate", "id": rid, "prompt": "x"})
                assert (await recv(ws))["type"] == "accepted"
            await wait_jobs(r, 3)
            await emit(r, "fast", [*tokens("fast", range(3)), done("fast", 3)])
            await emit(r, "failed", [error_event("failed", 0, "invalid_request", "no")])
            await asyncio.sleep(0.3)
            await emit(r, "slow", [*tokens("slow", range(2)), done("slow", 2)])
            events = await collect(ws, {"slow", "fast", "failed"})
            assert [e["type"] for e in events["failed"]] == ["error"]
        # A resume replays tokens generated before: nothing is timed.
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": "fast", "after_seq": -1})
            assert len((await collect(ws, {"fast"}))["fast"]) == 4
        page = await samples(gw)
        assert ttft(page, "ws") == 2 and ttft(page, "openai") == 0
        assert ttft(page, "ws", "bucket", "+Inf") == 2
        assert ttft(page, "ws", "bucket", "0.25") <= 1  # `slow` is above 0.25 s, wherever `fast` is
        assert 0.3 <= ttft(page, "ws", "sum") < 30
        # vLLM's TTFT buckets, as the worker's histogram has them.
        bounds = sorted(float(dict(labels)["le"]) for name, labels in page
                        if name == f"{TTFT}_bucket" and dict(labels)["protocol"] == "ws")
        assert bounds == [*TTFT_BUCKETS, float("inf")]

        # --- OpenAI API: a streamed chat answer counts once however many tokens it has; a streamed
        # completion of two prompts (two jobs) is one request and counts once; a streamed answer that
        # fails first, a whole (non-streamed) answer and a resumed stream relay no first token.
        async def streamed(path: str, body: dict[str, Any], rid: str) -> list[str]:
            async with http.stream("POST", path, json=body, headers={"X-Request-Id": rid}) as resp:
                assert resp.status_code == 200
                return await read_sse(resp)

        chat_stream = asyncio.ensure_future(streamed("/chat/completions", chat(), "o-chat"))
        await until(gw, lambda p: open_now(p, "sse") == 1)
        await emit(r, "o-chat", [*tokens("o-chat", range(4)), done("o-chat", 4)])
        assert (await chat_stream)[-1] == "[DONE]"
        two = asyncio.ensure_future(streamed("/completions", {"model": "tiny", "prompt": ["a", "b"],
                                                              "stream": True}, "o-two"))
        await until(gw, lambda p: open_now(p, "sse") == 1)
        for rid in ("o-two.0", "o-two.1"):
            await emit(r, rid, [*tokens(rid, range(2)), done(rid, 2)])
        assert (await two)[-1] == "[DONE]"
        failing = asyncio.ensure_future(streamed("/chat/completions", chat(), "o-fail"))
        await until(gw, lambda p: open_now(p, "sse") == 1)
        await emit(r, "o-fail", [error_event("o-fail", 0, "invalid_request", "no")])
        assert (await failing)[-1] == "[DONE]"
        whole = asyncio.ensure_future(http.post("/chat/completions", json=chat(stream=False),
                                                headers={"X-Request-Id": "o-whole"}))
        await wait_jobs(r, 8)  # 3 WebSocket jobs, o-chat, o-two.0, o-two.1, o-fail, o-whole
        await emit(r, "o-whole", [*tokens("o-whole", range(2)), done("o-whole", 2)])
        assert (await whole).status_code == 200
        async with http.stream("GET", "/streams/o-chat?after=-1") as resp:
            replayed = await read_sse(resp)
            assert replayed[-1] == "[DONE]" and len(replayed) > 4
        page = await samples(gw)
        assert ttft(page, "openai") == 2 and ttft(page, "ws") == 2
        assert ttft(page, "openai", "bucket", "+Inf") == 2
        assert page[(PREFIX + "requests_total", ())] == 8
    await r.aclose()


@pytest.mark.anyio
async def test_open_connection_gauges_go_up_and_down(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=30) as http:
        page = await samples(gw)
        assert (open_now(page, "ws"), open_now(page, "sse")) == (0, 0)
        # WebSockets: two open, then one, then none; the old gauge says the same.
        async with connect(gw.ws_url) as one:
            async with connect(gw.ws_url):
                page = await until(gw, lambda p: open_now(p, "ws") == 2)
                assert page[(PREFIX + "connections_open", ())] == 2 and open_now(page, "sse") == 0
            page = await until(gw, lambda p: open_now(p, "ws") == 1)
            await send(one, {"type": "generate", "id": "w", "prompt": "x"})
            assert (await recv(one))["type"] == "accepted"
            page = await until(gw, lambda p: p[(PREFIX + "requests_inflight", ())] == 1)
            assert page[(PREFIX + "connections_open", ())] == 1
        page = await until(gw, lambda p: open_now(p, "ws") == 0)
        assert page[(PREFIX + "connections_open", ())] == 0 and page[(PREFIX + "requests_inflight", ())] == 0

        # SSE streams: two open; one ends with its answer, the other's client goes away mid-stream.
        async with http.stream("POST", "/chat/completions", json=chat(), headers={"X-Request-Id": "s-left"}) as left:
            assert left.status_code == 200
            async with http.stream("POST", "/chat/completions", json=chat(),
                                   headers={"X-Request-Id": "s-done"}) as finished:
                page = await until(gw, lambda p: open_now(p, "sse") == 2)
                assert open_now(page, "ws") == 0
                await emit(r, "s-done", [*tokens("s-done", range(2)), done("s-done", 2)])
                assert (await read_sse(finished))[-1] == "[DONE]"
            await until(gw, lambda p: open_now(p, "sse") == 1)
            await emit(r, "s-left", tokens("s-left", range(1)))
            async for line in left.aiter_lines():  # its first token, then the client hangs up
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
        await until(gw, lambda p: open_now(p, "sse") == 0)
        # A whole (non-streamed) answer is no stream.
        whole = asyncio.ensure_future(http.post("/chat/completions", json=chat(stream=False),
                                                headers={"X-Request-Id": "s-whole"}))
        await wait_jobs(r, 4)
        assert open_now(await samples(gw), "sse") == 0
        await emit(r, "s-whole", [*tokens("s-whole", range(1)), done("s-whole", 1)])
        assert (await whole).status_code == 200
    await r.aclose()


@pytest.mark.anyio
async def test_the_page_keeps_every_name_and_speaks_openmetrics(redis_url: str) -> None:
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        await ws.send("not json")
        assert (await recv(ws))["code"] == "bad_json"
        content_type, text = await scrape(gw)
        assert content_type.startswith("text/plain; version=0.0.4")
        for name in OLD_NAMES:
            kind = "gauge" if name in ("connections_open", "requests_inflight") else "counter"
            assert f"# TYPE {PREFIX}{name} {kind}\n" in text, name
        assert f'{PREFIX}errors_total{{code="bad_json"}} 1.0\n' in text
        assert f"# TYPE {TTFT} histogram\n" in text and f"# TYPE {OPEN} gauge\n" in text
        # prometheus_client's `*_created` samples are left out (a gauge
        # `streamer_gateway_connections_created` would read like a count).
        assert "_created" not in text
        # A scraper that asks for OpenMetrics (Prometheus does) gets it, with the same samples.
        content_type, om = await scrape(gw, "application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
        assert content_type.startswith("application/openmetrics-text") and om.endswith("# EOF\n")
        assert f'{PREFIX}errors_total{{code="bad_json"}} 1.0\n' in om and "_created" not in om
        # Its own registry: a second gateway in this process starts from zero.
        async with running_gateway(config(redis_url)) as other:
            _, fresh = await scrape(other)
            assert f"{PREFIX}connections_total 0.0\n" in fresh and "bad_json" not in fresh
