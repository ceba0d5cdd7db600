"""The gateway against a real Redis, with the worker's side played by the test: it reads the jobs the
gateway pushed and writes events into Redis exactly as the wire contract says (stream entry `0-(seq+1)`
plus a publish). End-to-end runs with the real worker are in test_gateway_e2e.py."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import replace
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Close
from websockets.protocol import State
from websockets.uri import parse_uri

from clients.events import done_event, token_event
from clients.protocol import Names, decode_job, encode, event_stream_id
from workers.gateway.config import GatewayConfig
from workers.gateway.server import running_gateway
from workers.gateway.session import CLOSE_SLOW_CONSUMER
from workers.redis_server import RedisServer

NAMES = Names()



def config(redis_url: str, **overrides: Any) -> GatewayConfig:
    return replace(GatewayConfig(port=0, redis_url=redis_url, idle_poll_s=1.0), **overrides)


# --- helpers shared with test_gateway_e2e.py and test_browser.py -----------------------------------

def without_workers(frame: dict[str, Any]) -> dict[str, Any]:
    """An `accepted` frame without its `workers` count (whether the gateway has looked yet is timing)."""
    return {k: v for k, v in frame.items() if k != "workers"}


async def recv(ws: ClientConnection, timeout: float = 10.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws: ClientConnection, frame: dict[str, Any]) -> None:
    await ws.send(json.dumps(frame))


async def collect(ws: ClientConnection, ids: set[str], timeout: float = 30.0,
                  strays: list[dict] | None = None) -> dict[str, list[dict]]:
    """Every event per id until each has ended (done/error); `accepted` frames are skipped, frames of
    no id in `ids` go to `strays` (an error without it)."""
    out: dict[str, list[dict]] = {i: [] for i in ids}
    open_ids = set(ids)

    async def loop() -> None:
        while open_ids:
            frame = json.loads(await ws.recv())
            if frame.get("type") == "accepted":
                continue
            if frame.get("id") not in ids:
                assert strays is not None, frame
                strays.append(frame)
                continue
            out[frame["id"]].append(frame)
            if frame["type"] in ("done", "error"):
                open_ids.discard(frame["id"])

    await asyncio.wait_for(loop(), timeout)
    return out


def assert_contiguous(events: list[dict], start: int = 0) -> None:
    assert [e["seq"] for e in events] == list(range(start, start + len(events))), [e["seq"] for e in events]
    assert events[-1]["type"] in ("done", "error")
    assert all(e["type"] == "token" for e in events[:-1])


def _http_get(url: str, headers: dict[str, str]) -> tuple[int, Message, bytes]:
    """Status, headers (names case-insensitive, as HTTP has them) and body."""
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


async def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Message, bytes]:
    """From a thread: the gateway under test runs on this event loop."""
    return await asyncio.to_thread(_http_get, url, headers or {})


def node_command() -> list[str]:
    """Node.js, with the flag Node 20-21 need for their (experimental) WebSocket class."""
    node = shutil.which("node")
    assert node, "Node.js is needed to test the JS client (apt-get install nodejs; see .ci/install)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    return [node, "--experimental-websocket"] if int(version.strip()[1:].split(".")[0]) < 22 else [node]


# --- the worker's side, played by the test ---------------------------------------------------------

async def emit(r: aioredis.Redis, rid: str, events: list[dict], *, store: bool = True,
               publish: bool = True) -> None:
    async with r.pipeline(transaction=False) as pipe:
        for ev in events:
            data = encode(ev, "json")
            if store:
                pipe.xadd(NAMES.events(rid), {"json": data}, id=event_stream_id(ev["seq"]))
            if publish:
                pipe.publish(NAMES.tokens(rid), data)
        await pipe.execute()


def tokens(rid: str, seqs: range, text: str = "t") -> list[dict]:
    return [token_event(rid, s, 0, [s], f"{text}{s}") for s in seqs]


def done(rid: str, seq: int, reason: str = "length") -> dict:
    return done_event(rid, seq, [reason], {"prompt_tokens": 1, "completion_tokens": seq, "cached_tokens": 0})


async def wait_jobs(r: aioredis.Redis, n: int, timeout: float = 5.0) -> list[Any]:
    async def poll() -> list[Any]:
        while True:
            entries = await r.xrange(NAMES.requests)
            if len(entries) >= n:
                return [decode_job(fields) for _, fields in entries]
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(poll(), timeout)


# --- tests -----------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_generate_pushes_job_and_relays_events_in_order(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        await send(ws, {"type": "generate", "id": "g1", "messages": [{"role": "user", "content": "hi"}],
                        "params": {"max_tokens": 5, "temperature": 0}})
        assert without_workers(await recv(ws)) == {"type": "accepted", "id": "g1"}
        (job,) = await wait_jobs(r, 1)
        assert (job.id, job.messages, job.params, job.encoding) == (
            "g1", [{"role": "user", "content": "hi"}], {"max_tokens": 5, "temperature": 0}, "json")
        # Out of order on the channel (seq 2 before 1): delivered in order, each once.
        await emit(r, "g1", tokens("g1", range(0, 1)))
        await emit(r, "g1", tokens("g1", range(1, 2)), publish=False)
        await emit(r, "g1", tokens("g1", range(2, 3)))
        await emit(r, "g1", tokens("g1", range(1, 2)), store=False)
        await emit(r, "g1", tokens("g1", range(3, 5)) + [done("g1", 5)])
        events = (await collect(ws, {"g1"}))["g1"]
        assert_contiguous(events)
        assert "".join(e["text"] for e in events) == "t0t1t2t3t4"
        assert events[-1]["finish_reason"] == "length"
    await r.aclose()


@pytest.mark.anyio
async def test_a_wedged_pubsub_connection_is_replaced_not_every_request_failed(redis_url: str) -> None:
    """A pub/sub connection that stops answering SUBSCRIBE (seen after Redis restarts under load)
    would make every request wait and fail: the gateway replaces it and the request goes on live."""
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url, idle_poll_s=60.0)) as gw, connect(gw.ws_url) as ws:
        wedged = gw.hub.relay.pubsub

        async def silent(*channels: Any) -> None:  # the command never reaches Redis: no confirmation
            return None

        wedged.subscribe = silent
        await send(ws, {"type": "generate", "id": "w1", "prompt": "x"})
        assert without_workers(await recv(ws, timeout=15)) == {"type": "accepted", "id": "w1"}
        assert gw.hub.relay.pubsub is not wedged
        await emit(r, "w1", tokens("w1", range(0, 2)) + [done("w1", 2)])  # live, by pub/sub only
        events = (await collect(ws, {"w1"}, timeout=10))["w1"]
        assert_contiguous(events)
        assert [e["type"] for e in events] == ["token", "token", "done"]
        # One catch-up read when the fresh connection came up (what was published before it is only
        # in the stream); the events themselves came live.
        assert gw.metrics.values["stream_fills_total"] <= 1
    await r.aclose()


@pytest.mark.anyio
async def test_missed_publish_is_filled_from_the_stream(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url, idle_poll_s=0.3)) as gw, connect(gw.ws_url) as ws:
        await send(ws, {"type": "generate", "id": "m1", "prompt": "x"})
        await recv(ws)
        await emit(r, "m1", tokens("m1", range(0, 2)), publish=False)  # only in the stream: a gap
        await emit(r, "m1", tokens("m1", range(2, 3)))  # seq 2 arrives live first
        await emit(r, "m1", [done("m1", 3)], publish=False)  # the end is never published: idle poll
        events = (await collect(ws, {"m1"}, timeout=5))["m1"]
        assert_contiguous(events)
    await r.aclose()


@pytest.mark.anyio
async def test_lossy_pubsub_still_delivers_every_event_once_in_order(redis_url: str) -> None:
    """A third of the live messages never arrive and the clients drop and resume at random points:
    every stream still comes out complete, in order, without duplicates."""
    rng = random.Random(7)
    r = aioredis.Redis.from_url(redis_url)
    ids = [f"l{i}" for i in range(12)]
    n = 25
    async with running_gateway(config(redis_url, idle_poll_s=0.3, cancel_grace_s=30)) as gw:
        seen: dict[str, list[dict]] = {rid: [] for rid in ids}

        async def follow(rid: str) -> None:
            async with connect(gw.ws_url) as ws:
                await send(ws, {"type": "generate", "id": rid, "prompt": "x"})
                while True:  # drop the socket after a few events, then resume where we were
                    frame = await recv(ws)
                    if frame["type"] != "accepted":
                        seen[rid].append(frame)
                    if frame["type"] == "done" or (frame["type"] == "token" and rng.random() < 0.1):
                        break
            while seen[rid][-1]["type"] != "done":
                async with connect(gw.ws_url) as ws:
                    await send(ws, {"type": "resume", "id": rid, "after_seq": seen[rid][-1]["seq"]})
                    while (frame := await recv(ws))["type"] != "done" and rng.random() > 0.1:
                        seen[rid].append(frame)
                    if frame["type"] == "done":
                        seen[rid].append(frame)

        async def produce() -> None:
            await wait_jobs(r, len(ids))
            for seq in range(n + 1):
                for rid in ids:
                    ev = tokens(rid, range(seq, seq + 1))[0] if seq < n else done(rid, n)
                    await emit(r, rid, [ev], publish=rng.random() > 0.33)
                await asyncio.sleep(0.002)

        await asyncio.wait_for(asyncio.gather(produce(), *(follow(rid) for rid in ids)), 30)
    for rid in ids:
        assert_contiguous(seen[rid])
        assert len(seen[rid]) == n + 1
    await r.aclose()


@pytest.mark.anyio
async def test_many_requests_on_one_socket(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    ids = [f"c{i}" for i in range(8)]
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        for rid in ids:
            await send(ws, {"type": "generate", "id": rid, "prompt": rid})
        await wait_jobs(r, len(ids))
        for step in range(6):  # interleaved, as one engine step writes for every request
            await asyncio.gather(*(emit(r, rid, tokens(rid, range(step, step + 1), rid)) for rid in ids))
        await asyncio.gather(*(emit(r, rid, [done(rid, 6)]) for rid in ids))
        got = await collect(ws, set(ids))
    for rid in ids:
        assert_contiguous(got[rid])
        assert "".join(e["text"] for e in got[rid]) == "".join(f"{rid}{s}" for s in range(6))
    await r.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("rid", ["r1", "team:a:1"])  # ids may hold `:`, the SSE id separator
async def test_resume_after_disconnect_has_no_gap_or_duplicate(redis_url: str, rid: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url, cancel_grace_s=5)) as gw:
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": rid, "prompt": "x"})
            await recv(ws)
            await emit(r, rid, tokens(rid, range(0, 4)))
            first = [await recv(ws) for _ in range(3)]  # the client saw seq 0-2, then its socket died
        await emit(r, rid, tokens(rid, range(4, 7)))  # generated while nobody listened
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": rid, "after_seq": first[-1]["seq"]})
            await asyncio.sleep(0.2)
            await emit(r, rid, tokens(rid, range(7, 9)) + [done(rid, 9)])
            rest = (await collect(ws, {rid}))[rid]
        assert_contiguous(first + rest)
        # Resuming a finished request replays it; resuming past its end says so.
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": rid})
            assert_contiguous((await collect(ws, {rid}))[rid])
            await send(ws, {"type": "resume", "id": rid, "after_seq": 9})
            assert (await recv(ws))["code"] == "already_finished"
        assert not await r.exists(NAMES.cancelled(rid))  # resumed within the grace period
    await r.aclose()


async def _cancels(r: aioredis.Redis) -> aioredis.client.PubSub:
    """A subscriber on the cancel channel: what the worker would hear."""
    pubsub = r.pubsub()
    await pubsub.subscribe(NAMES.cancel)
    await pubsub.get_message(timeout=1)  # subscribe confirmation
    return pubsub


async def _drain_cancels(pubsub: aioredis.client.PubSub, seconds: float) -> list[str]:
    got: list[str] = []
    end = asyncio.get_running_loop().time() + seconds
    while (left := end - asyncio.get_running_loop().time()) > 0:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
        if msg is not None:
            got.append(msg["data"].decode())
    return got


@pytest.mark.anyio
async def test_closed_socket_cancels_after_grace_unless_resumed(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    pubsub = await _cancels(r)
    async with running_gateway(config(redis_url, cancel_grace_s=0.5)) as gw:
        async with connect(gw.ws_url) as ws:
            for rid in ("lost", "kept"):
                await send(ws, {"type": "generate", "id": rid, "prompt": "x"})
                await recv(ws)
        assert await _drain_cancels(pubsub, 0.2) == []  # not before the grace period
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": "kept"})
            assert await _drain_cancels(pubsub, 0.8) == ["lost"]
            assert await r.exists(NAMES.cancelled("lost")) and not await r.exists(NAMES.cancelled("kept"))
            # An explicit cancel frame works for any id the client knows.
            await send(ws, {"type": "cancel", "id": "kept"})
            assert await _drain_cancels(pubsub, 0.5) == ["kept"]
    async with running_gateway(config(redis_url, cancel_grace_s=0)) as gw:
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": "now", "prompt": "x"})
            await recv(ws)
        assert await _drain_cancels(pubsub, 0.5) == ["now"]
    await pubsub.aclose()
    await r.aclose()


@pytest.mark.anyio
async def test_resume_through_another_gateway_stops_the_grace_cancel(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    pubsub = await _cancels(r)
    async with running_gateway(config(redis_url, cancel_grace_s=0.5)) as a, \
            running_gateway(config(redis_url, cancel_grace_s=0.5)) as b:
        async with connect(a.ws_url) as ws:
            for rid in ("moved", "dropped"):
                await send(ws, {"type": "generate", "id": rid, "prompt": "x"})
                await recv(ws)
        async with connect(b.ws_url) as ws:  # the browser came back through the other gateway
            await send(ws, {"type": "resume", "id": "moved"})
            assert await _drain_cancels(pubsub, 1.0) == ["dropped"]
        # The resume can also reach Redis before the first gateway notices its socket closed (its
        # pub/sub notice then finds no timer to stop): the timer must find the resume in Redis.
        early = await connect(a.ws_url)
        await send(early, {"type": "generate", "id": "early", "prompt": "x"})
        await recv(early)
        async with connect(b.ws_url) as ws:
            await send(ws, {"type": "resume", "id": "early"})
            await asyncio.sleep(0.2)
            await early.close()
            # "moved" is B's to cancel: its socket there closed above. "early" stays.
            assert await _drain_cancels(pubsub, 1.5) == ["moved"]
            await emit(r, "early", tokens("early", range(0, 1)) + [done("early", 1)])
            assert [e["type"] for e in (await collect(ws, {"early"}))["early"]] == ["token", "done"]
        assert a.metrics.values["grace_cancels_total"] == 1  # "dropped" only
    await pubsub.aclose()
    await r.aclose()


@pytest.mark.anyio
async def test_bad_frames_get_errors_and_the_socket_goes_on(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    cfg = config(redis_url, max_frame_bytes=4096, max_inflight=2)
    async with running_gateway(cfg) as gw, connect(gw.ws_url) as ws:
        await send(ws, {"type": "generate", "id": "ok1", "prompt": "x"})
        assert (await recv(ws))["type"] == "accepted"
        bad: list[tuple[Any, str]] = [
            ("not json", "bad_json"),
            (b"\x00\x01", "bad_frame"),
            ([1, 2], "bad_frame"),
            ({"type": "dance"}, "unknown_type"),
            ({"prompt": "no type"}, "unknown_type"),
            ({"type": "generate", "id": "a"}, "invalid_request"),  # no prompt
            ({"type": "generate", "id": "a", "prompt": 5}, "invalid_request"),
            ({"type": "generate", "id": "a", "prompt": "x", "params": [1]}, "invalid_params"),
            ({"type": "generate", "id": "a", "prompt": "x", "colour": "red"}, "invalid_request"),
            ({"type": "generate", "id": "bad id!", "prompt": "x"}, "invalid_request"),
            ({"type": "generate", "id": "a", "messages": [{"role": "user"}]}, "invalid_request"),
            ({"type": "generate", "id": "a", "prompt": "x" * 5000}, "too_large"),
            ({"type": "generate", "id": "ok1", "prompt": "x"}, "duplicate_id"),
            ({"type": "resume", "id": "nobody"}, "unknown_request"),
            ({"type": "resume", "id": "ok1", "after_seq": "3"}, "invalid_request"),
            ({"type": "cancel", "id": 7}, "invalid_request"),
        ]
        for frame, code in bad:
            await ws.send(frame if isinstance(frame, str | bytes) else json.dumps(frame))
            reply = await recv(ws)
            assert (reply["type"], reply["code"], reply["source"]) == ("error", code, "gateway"), (frame, reply)
            assert reply["message"]
        await send(ws, {"type": "generate", "id": "ok2", "prompt": "x"})
        assert (await recv(ws))["type"] == "accepted"
        await send(ws, {"type": "generate", "id": "ok3", "prompt": "x"})  # a third one in flight
        assert (await recv(ws))["code"] == "too_many_requests"
        assert [j.id for j in await wait_jobs(r, 2)] == ["ok1", "ok2"]  # nothing bad reached Redis
        await emit(r, "ok1", [done("ok1", 0)])
        await emit(r, "ok2", [done("ok2", 0)])
        assert set(await collect(ws, {"ok1", "ok2"})) == {"ok1", "ok2"}
        _, _, metrics = await http_get(gw.url + "metrics")
        assert 'streamer_gateway_errors_total{code="bad_json"} 1' in metrics.decode()
    # Beyond the hard limit the frame is not even read: websockets closes with 1009.
    async with running_gateway(cfg) as gw, connect(gw.ws_url, max_size=None) as ws:
        await ws.send("x" * (cfg.hard_frame_limit + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await recv(ws)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    await r.aclose()


@pytest.mark.anyio
async def test_api_keys_and_origins_refuse_before_any_job(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    cfg = config(redis_url, api_keys=("k-one", "k-two"))
    async with running_gateway(cfg) as gw:
        for url, headers in [(gw.ws_url, {}), (gw.ws_url + "?token=nope", {}),
                             (gw.ws_url, {"Authorization": "Bearer k-three"})]:
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url, additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 401
        for url, headers in [(gw.ws_url + "?token=k-two", {}), (gw.ws_url, {"Authorization": "Bearer k-one"})]:
            async with connect(url, additional_headers=headers) as ws:
                await send(ws, {"type": "generate", "id": f"a{len(headers)}", "prompt": "x"})
                assert (await recv(ws))["type"] == "accepted"
        assert (await http_get(gw.url + "metrics"))[0] == 401
        assert (await http_get(gw.url + "metrics", {"Authorization": "Bearer k-one"}))[0] == 200
        assert (await http_get(gw.url))[0] == 200  # the page itself is public; the key goes in its settings
    assert await r.xlen(NAMES.requests) == 2
    async with running_gateway(config(redis_url, max_connections=1)) as gw, connect(gw.ws_url):
        with pytest.raises(InvalidStatus) as refused:
            async with connect(gw.ws_url):
                pass
        assert refused.value.response.status_code == 503
    async with running_gateway(config(redis_url)) as gw:
        host = f"127.0.0.1:{gw.port}"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(gw.ws_url, origin="http://evil.example"):  # type: ignore[arg-type]
                pass
        assert refused.value.response.status_code == 403
        async with connect(gw.ws_url, origin=f"http://{host}"):  # type: ignore[arg-type]
            pass
    async with running_gateway(config(redis_url, allowed_origins=("https://chat.example",))) as gw:
        async with connect(gw.ws_url, origin="https://chat.example"):  # type: ignore[arg-type]
            pass
        with pytest.raises(InvalidStatus):
            async with connect(gw.ws_url, origin=f"http://127.0.0.1:{gw.port}"):  # type: ignore[arg-type]
                pass
    await r.aclose()


@pytest.mark.anyio
async def test_http_page_health_and_metrics(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw:
        get = lambda path: http_get(gw.url + path)  # noqa: E731
        status, headers, body = await get("")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b'src="/app.js"' in body and "default-src 'self'" in headers["Content-Security-Policy"]
        status, headers, body = await get("streamer-client.js")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript")
        assert b"export class StreamerClient" in body
        assert (await get("../pyproject.toml"))[0] == 404
        assert (await get("%2e%2e/pyproject.toml"))[0] == 404
        assert (await get("nothing.js"))[0] == 404
        assert (await get("ws"))[0] == 426  # /ws is for WebSocket upgrades only
        status, _, body = await get("healthz")
        assert status == 503 and json.loads(body) == {"ok": False, "redis": True, "pubsub": True, "workers": [],
                                                      "connections": 0}
        await r.hset(NAMES.worker("w1"), mapping={"model": "tiny", "running": "0"})
        await r.pexpire(NAMES.worker("w1"), 5000)
        seconds, micros = await r.time()  # a worker's beat: its name in the heartbeat set, at Redis time
        await r.zadd(NAMES.heartbeats, {"w1": seconds * 1000 + micros // 1000})
        status, _, body = await get("healthz")
        assert status == 200
        assert json.loads(body)["workers"] == [{"name": "w1", "model": "tiny", "running": "0"}]
        status, headers, body = await get("metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "# TYPE streamer_gateway_events_relayed_total counter" in body.decode()
    await r.aclose()
    # Redis gone: unhealthy, and says why.
    with RedisServer() as own:
        async with running_gateway(config(own.url)) as gw:
            own.stop()
            status, _, body = await http_get(gw.url + "healthz")
            assert status == 503 and json.loads(body)["redis"] is False


@pytest.mark.anyio
async def test_redis_restart_mid_stream_loses_nothing() -> None:
    """redis-server restarts (AOF on) while a request streams: the gateway's pub/sub reconnects and
    the events written meanwhile are read from the stream."""
    with RedisServer(appendonly=True) as own:
        async with running_gateway(config(own.url)) as gw, connect(gw.ws_url) as ws:
            r = aioredis.Redis.from_url(own.url)
            await send(ws, {"type": "generate", "id": "x1", "prompt": "p"})
            await recv(ws)
            await emit(r, "x1", tokens("x1", range(0, 3)))
            await r.aclose()
            await asyncio.to_thread(own.restart, 0.5)
            r = aioredis.Redis.from_url(own.url)
            await emit(r, "x1", tokens("x1", range(3, 6)) + [done("x1", 6)])
            assert_contiguous((await collect(ws, {"x1"}, timeout=15))["x1"])
            assert gw.metrics.values["redis_errors_total"] >= 1
            await r.aclose()


# --- slow consumer -------------------------------------------------------------------------------

class StalledClient:
    """A WebSocket client that stops reading after the handshake: a tiny receive buffer set before
    connecting, and nobody reading it, so the gateway's sends back up for real."""

    def __init__(self, url: str) -> None:
        from websockets.client import ClientProtocol

        self.protocol = ClientProtocol(parse_uri(url), max_size=None)
        u = parse_uri(url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((u.host, u.port))
        self.sock.settimeout(10)
        self.protocol.send_request(self.protocol.connect())
        self._flush()
        while self.protocol.state is State.CONNECTING:
            data = self.sock.recv(65536)
            assert data, "gateway closed during the handshake"
            self.protocol.receive_data(data)
        assert self.protocol.state is State.OPEN, self.protocol.handshake_exc
        self.protocol.events_received()

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            if data:
                self.sock.sendall(data)

    def send(self, frame: dict[str, Any]) -> None:
        self.protocol.send_text(json.dumps(frame).encode())
        self._flush()

    def read_until_closed(self) -> Close | None:
        """Now read everything the kernel buffered, up to the close frame."""
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                self.protocol.receive_eof()
            else:
                self.protocol.receive_data(data)
            for event in self.protocol.events_received():
                if getattr(event, "opcode", None) is not None and event.opcode.name == "CLOSE":
                    return Close.parse(event.data)
            if not data:
                return None


@pytest.mark.anyio
async def test_slow_reader_is_closed_while_a_fast_one_finishes(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    cfg = config(redis_url, send_queue_bytes=256 * 1024, cancel_grace_s=60, close_timeout_s=1)
    big = "x" * 16384
    # The slow reader follows a request whose events are large: 600 x 16 KiB is far more than the
    # socket buffers and the send queue together.
    await emit(r, "slow", [token_event("slow", s, 0, [1], big) for s in range(600)], publish=False)
    async with running_gateway(cfg) as gw, connect(gw.ws_url) as fast:
        stalled = await asyncio.to_thread(StalledClient, gw.ws_url)
        stalled.send({"type": "resume", "id": "slow"})
        await send(fast, {"type": "generate", "id": "fast", "prompt": "x"})
        await recv(fast)
        # Events come after the job exists, as from a worker that read it (the push refuses an id that
        # already has events: written earlier, they made the gateway answer duplicate_id).
        while not await r.exists(NAMES.job("fast")):
            await asyncio.sleep(0.01)
        for s in range(20):
            await emit(r, "fast", tokens("fast", range(s, s + 1)))
            await asyncio.sleep(0.005)
        await emit(r, "fast", [done("fast", 20)])
        assert_contiguous((await collect(fast, {"fast"}, timeout=10))["fast"])

        async def closed() -> None:
            while gw.metrics.values["slow_consumer_closes_total"] < 1:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(closed(), 10)
        close = await asyncio.to_thread(stalled.read_until_closed)
        assert close is not None and close.code == CLOSE_SLOW_CONSUMER, close
        assert "resume" in close.reason
        assert not await r.exists(NAMES.cancelled("slow"))  # still resumable within the grace period
    await r.aclose()


# --- the JS client ---------------------------------------------------------------------------------

RECONNECT_SCRIPT = """
import { StreamerClient } from %(client)s;
const statuses = [];
const client = new StreamerClient(process.argv[2], { maxBackoffMs: 300, onStatus: (s) => statuses.push(s) });
const stream = client.generate({ id: "n1", prompt: "x" });
const seqs = [];
let text = "";
for await (const event of stream) {
  seqs.push(event.seq);
  if (event.type === "token") text += event.text;
  console.log(JSON.stringify({ seq: event.seq }));
}
console.log(JSON.stringify({ seqs, text, statuses }));
client.close();
"""


@pytest.mark.anyio
async def test_js_client_reconnects_and_resumes_across_a_gateway_restart(redis_url: str, tmp_path: Path) -> None:
    """The gateway goes away mid-answer (tokens keep coming into Redis) and comes back on the same port:
    the JS client reconnects and resumes after the last seq it had, with nothing lost or repeated."""
    script = tmp_path / "reconnect.mjs"
    client_url = (Path(__file__).resolve().parents[2] / "clients" / "web" / "streamer-client.js").as_uri()
    script.write_text(RECONNECT_SCRIPT % {"client": json.dumps(client_url)})
    r = aioredis.Redis.from_url(redis_url)
    first = running_gateway(config(redis_url))
    gw = await first.__aenter__()
    port = gw.port
    proc = await asyncio.create_subprocess_exec(*node_command(), str(script), gw.ws_url,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async def line() -> dict[str, Any]:
            return json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))  # type: ignore[union-attr]

        await wait_jobs(r, 1)
        await emit(r, "n1", tokens("n1", range(0, 5)))
        assert [(await line())["seq"] for _ in range(5)] == [0, 1, 2, 3, 4]
        await first.__aexit__(None, None, None)
        await emit(r, "n1", tokens("n1", range(5, 9)))  # while no gateway is up
        async with running_gateway(config(redis_url, port=port)):
            await emit(r, "n1", tokens("n1", range(9, 12)) + [done("n1", 12)])
            seen = [(await line())["seq"] for _ in range(8)]
            summary = await line()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert seen == list(range(5, 13))
    assert summary["seqs"] == list(range(13))
    assert summary["text"] == "".join(f"t{s}" for s in range(12))
    assert summary["statuses"] == ["connecting", "open", "reconnecting", "open"]
    assert not await r.exists(NAMES.cancelled("n1"))  # a gateway shutting down cancels nothing
    await r.aclose()
