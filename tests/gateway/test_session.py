"""The WebSocket session (workers/gateway/session.py) frame by frame: each refusal's exact code, id and
message, the limits per connection at their edges, the `accepted` frame's worker count, what a failing
Redis or a bug in the gateway is answered with, and the close of a gateway shutting down. The worker's
side is played by the test (test_gateway.py's helpers); Redis and the gateway are real."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest
import redis.asyncio as aioredis
from test_gateway import NAMES, config, done, emit, http_get, recv, send, tokens, wait_jobs
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from workers.gateway import frames
from workers.gateway.server import running_gateway
from workers.gateway.session import CLOSE_SLOW_CONSUMER, SLOW_CONSUMER_REASON, Session

MAX_FRAME = 4096 * 64  # above the deepest frame below, so that it is refused for its depth
DEEP = "[" * 100_000 + "]" * 100_000


async def reply_to(ws: ClientConnection, frame: str | bytes | dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame) if isinstance(frame, dict) else frame)
    return await recv(ws)


def refusal(reply: dict[str, Any]) -> tuple[str, str | None, str]:
    assert (reply["type"], reply["source"]) == ("error", "gateway"), reply
    return reply["code"], reply["id"], reply["message"]


def not_json(text: str) -> str:
    """The message of a frame the JSON decoder refuses, as the gateway words it."""
    try:
        json.loads(text, parse_constant=frames.reject_constant)
    except ValueError as e:
        return f"frame is not JSON: {e}"
    raise AssertionError(f"{text!r} is JSON")


def generate(rid: str, **fields: Any) -> dict[str, Any]:
    return {"type": "generate", "id": rid, "prompt": "x", **fields}


@pytest.mark.anyio
async def test_each_refused_frame_is_answered_with_its_code_id_and_message(redis_url: str) -> None:
    long_type = "t" * 300
    cases: list[tuple[str | bytes, tuple[str, str | None, str]]] = [
        (b'{"type": "generate"}', ("bad_frame", None, "frames must be JSON text, not binary")),
        ("[1, 2]", ("bad_frame", None, "a frame must be a JSON object with a `type`")),
        ('{"type": "gen', ("bad_json", None, not_json('{"type": "gen'))),
        ('{"type":"generate","id":"nan","prompt":"x","params":{"temperature":NaN}}',
         ("bad_json", "nan", "frame is not JSON: NaN is not JSON")),
        ('{"type":"generate","id":"deep","prompt":"x","params":{"a":' + DEEP + "}}",
         ("bad_json", "deep", "frame is nested too deeply to decode")),
        (json.dumps({"type": "stop", "id": "u1"}),
         ("unknown_type", "u1", "unknown frame type 'stop'; expected generate, cancel or resume")),
        # The client's text is quoted up to 200 characters, the list of types always follows.
        (json.dumps({"type": long_type, "id": "u2"}),
         ("unknown_type", "u2", f"unknown frame type '{long_type}'"[:200] + "; expected generate, cancel or resume")),
    ]
    async with running_gateway(config(redis_url, max_frame_bytes=MAX_FRAME)) as gw, \
            connect(gw.ws_url, max_size=None) as ws:
        for frame, expected in cases:
            assert refusal(await reply_to(ws, frame)) == expected, frame[:80]
        assert (await reply_to(ws, generate("fine")))["type"] == "accepted"  # the socket went on
        _, _, page = await http_get(gw.url + "metrics")
    for code, count in (("bad_frame", 2), ("bad_json", 3), ("unknown_type", 2)):
        assert f'streamer_gateway_errors_total{{code="{code}"}} {count}' in page.decode()


@pytest.mark.anyio
async def test_frames_up_to_the_limit_pass_in_bytes_not_characters(redis_url: str) -> None:
    """`max_frame_bytes` counts UTF-8 bytes: a frame of exactly the limit is read, one byte more is
    refused with its id, and so is a frame under the limit in characters but over it in bytes."""
    limit = 4096
    async with running_gateway(config(redis_url, max_frame_bytes=limit)) as gw, connect(gw.ws_url, max_size=None) as ws:
        def sized(rid: str, n: int, char: str = "x") -> str:
            frame = json.dumps(generate(rid, prompt=""), ensure_ascii=False)
            fill = (n - frames.size(frame)) // len(char.encode())
            return frame.replace('"prompt": ""', f'"prompt": "{char * fill}"')

        at, over, wide = sized("at", limit), sized("over", limit + 1), sized("wide", limit + 2, "é")
        assert (frames.size(at), frames.size(over), frames.size(wide)) == (limit, limit + 1, limit + 2)
        assert len(wide) <= limit
        assert (await reply_to(ws, at))["type"] == "accepted"
        for frame, rid in ((over, "over"), (wide, "wide")):
            assert refusal(await reply_to(ws, frame)) == ("too_large", rid, f"frame is over {limit} bytes")


@pytest.mark.anyio
async def test_a_connection_streams_at_most_max_inflight_requests_each_id_once(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url, max_inflight=2)) as gw, connect(gw.ws_url) as ws:
        assert (await reply_to(ws, generate("a")))["type"] == "accepted"
        assert refusal(await reply_to(ws, generate("a"))) == (
            "duplicate_id", "a", "request 'a' is already streaming on this connection")
        assert (await reply_to(ws, generate("b")))["type"] == "accepted"
        limit = "at most 2 requests in flight per connection: wait for one to finish or cancel one"
        assert refusal(await reply_to(ws, generate("c"))) == ("too_many_requests", "c", limit)
        assert refusal(await reply_to(ws, {"type": "resume", "id": "a"})) == (
            "duplicate_id", "a", "request 'a' is already streaming on this connection")
        # One ends: its place is free again.
        while not await r.exists(NAMES.job("a")):
            await asyncio.sleep(0.01)
        await emit(r, "a", [done("a", 0)])
        assert (await recv(ws))["type"] == "done"
        assert (await reply_to(ws, generate("c")))["type"] == "accepted"
    await r.aclose()


@pytest.mark.anyio
async def test_resume_positions_at_their_edges(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    position = "`after_seq` must be an integer >= -1 (the last seq received; -1 replays from the start)"
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        assert (await reply_to(ws, generate("q1")))["type"] == "accepted"
        while not await r.exists(NAMES.job("q1")):
            await asyncio.sleep(0.01)
        await emit(r, "q1", [*tokens("q1", range(0, 3)), done("q1", 3)])
        assert [(await recv(ws))["seq"] for _ in range(4)] == [0, 1, 2, 3]
        async with connect(gw.ws_url) as other:
            for after in (-2, "0", 1.5, frames.MAX_SEQ + 1):
                assert refusal(await reply_to(other, {"type": "resume", "id": "q1", "after_seq": after})) == (
                    "invalid_request", "q1", position), after
            assert refusal(await reply_to(other, {"type": "resume", "id": "q1", "after_seq": 3})) == (
                "already_finished", "q1", "request 'q1' finished at seq 3")
            # The last seq is 3: from 2 on, the done event alone; from -1 (the default), everything.
            assert (await reply_to(other, {"type": "resume", "id": "q1", "after_seq": 2}))["seq"] == 3
            await send(other, {"type": "resume", "id": "q1"})
            assert [(await recv(other))["seq"] for _ in range(4)] == [0, 1, 2, 3]
    await r.aclose()


@pytest.mark.anyio
async def test_accepted_says_how_many_workers_are_alive_once_known(redis_url: str) -> None:
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        while gw.workers_alive is None:  # its first look at the heartbeats; the next is seconds away
            await asyncio.sleep(0.01)
        for rid, alive in (("n", None), ("zero", 0), ("three", 3)):
            gw.workers_alive = alive  # what the gateway's look at the heartbeats found (None: not looked yet)
            expected: dict[str, Any] = {"type": "accepted", "id": rid}
            if alive is not None:
                expected["workers"] = alive
            assert await reply_to(ws, generate(rid)) == expected


@pytest.mark.anyio
async def test_redis_away_and_a_failing_gateway_are_answered_and_the_socket_goes_on(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamer.gateway")
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        real_push, real_release = gw.hub.push, gw.hub.release

        async def away(*args: Any) -> Any:
            raise aioredis.ConnectionError("Redis went away")

        async def bug(*args: Any) -> Any:
            raise RuntimeError("a bug")

        gw.hub.push, gw.hub.release = away, away  # type: ignore[method-assign]
        assert (await reply_to(ws, generate("f1")))["type"] == "accepted"  # sent just before the push
        assert refusal(await recv(ws)) == (
            "redis_unavailable", "f1", "the gateway cannot reach Redis right now; retry shortly")
        gw.hub.push, gw.hub.release = bug, real_release  # type: ignore[method-assign]
        assert (await reply_to(ws, generate("f2")))["type"] == "accepted"
        assert refusal(await recv(ws)) == (
            "internal", "f2", "the gateway failed on this frame (RuntimeError); retry, or report it if it persists")
        gw.hub.push = real_push  # type: ignore[method-assign]
        assert (await reply_to(ws, generate("f3")))["type"] == "accepted"
        assert gw.metrics.values["redis_errors_total"] == 1
    assert f"request f1: Redis unavailable: {aioredis.ConnectionError('Redis went away')!r}" in caplog.messages
    assert "request f2: generate frame failed" in caplog.messages


@pytest.mark.anyio
async def test_a_gateway_shutting_down_closes_each_socket_as_going_away(redis_url: str) -> None:
    async with running_gateway(config(redis_url, close_timeout_s=2)) as gw:
        ws = await connect(gw.ws_url)
        assert (await reply_to(ws, generate("g1")))["type"] == "accepted"
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    await ws.close()
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "gateway shutting down")


@pytest.mark.anyio
async def test_a_generate_without_an_id_gets_one_of_its_own(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        accepted = await reply_to(ws, {"type": "generate", "prompt": "x"})
        assert accepted["type"] == "accepted" and re.fullmatch(r"[0-9a-f]{32}", accepted["id"]), accepted
        assert [job.id for job in await wait_jobs(r, 1)] == [accepted["id"]]
        # Refused, it names no request: the id picked for it was never seen by the client.
        reply = await reply_to(ws, {"type": "generate", "prompt": "x", "params": {"temperature": -5}})
        assert refusal(reply)[:2] == ("invalid_params", None)
    await r.aclose()


class UnreadSocket:
    """A client that never reads: frames stay in the session's send queue (its writer is not started)."""

    id = "c1"

    def __init__(self) -> None:
        self.closed: tuple[int, str] | None = None

    async def close(self, code: int, reason: str, timeout_s: float) -> None:
        self.closed = (code, reason)


@pytest.mark.anyio
async def test_the_send_queue_holds_its_bytes_and_one_more_closes_the_socket(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamer.gateway")
    async with running_gateway(config(redis_url, send_queue_bytes=10)) as gw:
        def session(ws: UnreadSocket) -> Session:
            return Session(ws, gw.config, gw.hub, gw.metrics, gw.limits, grace=None)  # type: ignore[arg-type]

        alone = UnreadSocket()
        session(alone).send("x" * 20)  # a frame alone in the queue is held whatever its size
        full = UnreadSocket()
        s = session(full)
        s.send("a" * 6)
        s.send("b" * 4)  # exactly the queue's bytes
        await asyncio.sleep(0.05)
        assert (alone.closed, full.closed, gw.metrics.values["slow_consumer_closes_total"]) == (None, None, 0)
        s.send("c")  # one byte over
        await asyncio.sleep(0.05)
        assert full.closed == (CLOSE_SLOW_CONSUMER, SLOW_CONSUMER_REASON)
        # Closing: what follows is dropped, not queued towards a second overflow.
        s.send("d")
        s.send("e" * 10)
        await asyncio.sleep(0.05)
        assert gw.metrics.values["slow_consumer_closes_total"] == 1
    assert caplog.messages.count(f"connection c1: send queue over 10 bytes, closing ({CLOSE_SLOW_CONSUMER})") == 1
