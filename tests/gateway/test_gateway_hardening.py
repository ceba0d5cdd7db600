"""Small gateway defects seen under hostile load, each held to its fix against a real redis-server and
a real gateway: slow-loris connections, absurd `max_tokens`, an SSE resume past the end, and a watch
dropped while it waited for the pub/sub lock."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import config, emit, recv, send, tokens
from websockets.asyncio.client import connect

from workers.gateway.server import Gateway, running_gateway


def _closed_within(gw: Gateway, payload: bytes, seconds: float) -> bool:
    """Open a raw connection, send `payload` (part of a request's headers, or nothing), and report
    whether the gateway closed it within `seconds`."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=seconds) as sock:
        if payload:
            sock.sendall(payload)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                if sock.recv(4096) == b"":
                    return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


@pytest.mark.anyio
async def test_connections_slow_to_send_their_headers_are_closed(redis_url: str) -> None:
    async with running_gateway(config(redis_url, header_timeout_s=1.0)) as gw:
        partial = b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Slow: "
        results = await asyncio.gather(asyncio.to_thread(_closed_within, gw, partial, 4.0),
                                       asyncio.to_thread(_closed_within, gw, b"", 4.0))
        assert results == [True, True], "a slow-loris connection was held past the header deadline"
        # Served requests and WebSockets are not cut by it.
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(gw.url + "livez")).status_code == 200
        async with connect(gw.ws_url) as ws:
            await asyncio.sleep(1.8)
            await send(ws, {"type": "cancel", "id": "nobody"})
            assert (await recv(ws))["code"] == "unknown_request"


def test_the_header_deadline_is_a_flag() -> None:
    from workers.cli.main import command_parser
    from workers.gateway.command import config_from_args

    assert config_from_args(command_parser("gateway").parse_args([])).header_timeout_s == 10.0
    assert config_from_args(command_parser("gateway").parse_args(["--header-timeout", "2.5"])).header_timeout_s == 2.5


@pytest.mark.anyio
async def test_max_tokens_past_any_bound_is_refused_on_both_apis(redis_url: str) -> None:
    async with running_gateway(config(redis_url)) as gw:
        async with httpx.AsyncClient(base_url=gw.url + "v1", timeout=5) as http:
            chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            for name, body in (("max_tokens", {"model": "m", "prompt": "x"}), ("max_completion_tokens", chat)):
                path = "/completions" if "prompt" in body else "/chat/completions"
                r = await http.post(path, json={**body, name: 2**64})
                assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": "big", "prompt": "x", "params": {"max_tokens": 2**64}})
            refused = await recv(ws)
            assert (refused["type"], refused["code"], refused["id"]) == ("error", "invalid_params", "big"), refused
        assert await gw.hub.redis.xlen(gw.names.requests) == 0


@pytest.mark.anyio
async def test_an_sse_resume_past_the_last_event_is_refused_as_on_ws(redis_url: str) -> None:
    """/ws refuses an after_seq past the request's last event; the SSE stream used to answer it with
    `[DONE]` as if the stream had ended. Both refuse it now."""
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=10) as http:
        body = {"model": "m", "prompt": "x", "max_tokens": 8, "stream": True}
        async with http.stream("POST", "/completions", json=body, headers={"X-Request-Id": "p1"}) as resp:
            assert resp.status_code == 200
        await emit(r, "p1", tokens("p1", range(0, 3)))
        for attempt in (http.post("/completions", json=body, headers={"Last-Event-ID": "p1:7"}),
                        http.get("/streams/p1", params={"after": "7"})):
            refused = await attempt
            assert refused.status_code == 400 and refused.json()["error"]["code"] is None, refused.text
            assert "beyond" in refused.json()["error"]["message"]
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": "p1", "after_seq": 7})
            assert (await recv(ws))["code"] == "invalid_request"
        async with http.stream("GET", "/streams/p1", params={"after": "1"}) as resp:  # within: served
            assert resp.status_code == 200
    await r.aclose()


@pytest.mark.anyio
async def test_a_watch_dropped_while_it_waits_to_subscribe_is_no_error(redis_url: str) -> None:
    """Under load a watch can be dropped (its client went away) while it waits for the subscription
    lock; it used to fail with KeyError (an HTTP 500 on an SSE resume) when it got the lock."""
    async with running_gateway(config(redis_url)) as gw:
        relay = gw.hub.relay
        await relay._sub_lock.acquire()
        try:
            pending = asyncio.create_task(relay.watch("gone", 0, lambda event, text: None))
            while relay.names.tokens("gone") not in relay.watches:
                await asyncio.sleep(0.01)
            (w,) = relay.watches[relay.names.tokens("gone")]
            relay.unwatch(w)
        finally:
            relay._sub_lock.release()
        assert (await asyncio.wait_for(pending, 5)).closed
