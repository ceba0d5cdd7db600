"""The gateway under faults, against a real redis-server it restarts: it serves again within seconds
of Redis coming back and says it cannot serve (`/readyz` 503) while it cannot; an id whose job was
never pushed is not stranded. The worker's side is played by the test (as in test_gateway.py): it
reads the pushed jobs, writes their events and keeps a heartbeat alive."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import traceback
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import NAMES, config, done, emit, recv, send, tokens
from websockets.asyncio.client import connect

from clients.errors import ProtocolError
from clients.protocol import decode_job
from workers.gateway import hub as hub_module
from workers.gateway.server import Gateway, running_gateway
from workers.redis_server import RedisServer

TOKENS = 20


class FakeWorker:
    """Answers every job pushed to the requests stream with TOKENS tokens and a `done`, a few ms
    apart, through any number of Redis restarts; beats so /readyz sees a live worker."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tasks: set[asyncio.Task[None]] = set()
        # Its loops retry while Redis is away: they end on this too, not on a cancel alone (one
        # landing inside the client's own connect timeout can come out as a timeout, and be retried).
        self.stopped = False

    async def run(self) -> None:
        last = "0-0"
        while not self.stopped:
            r = aioredis.Redis.from_url(self.url, socket_timeout=5)
            try:
                while not self.stopped:
                    await self._beat(r)
                    for _, entries in await r.xread({NAMES.requests: last}, block=200, count=200) or []:
                        for entry_id, fields in entries:
                            last = entry_id
                            task = asyncio.create_task(self._answer(decode_job(fields).id))
                            self.tasks.add(task)
                            task.add_done_callback(self.tasks.discard)
            except (OSError, aioredis.ConnectionError, aioredis.TimeoutError):
                await asyncio.sleep(0.1)
            finally:
                await r.aclose()

    async def _beat(self, r: aioredis.Redis) -> None:
        seconds, micros = await r.time()
        await r.zadd(NAMES.heartbeats, {"fake": seconds * 1000 + micros // 1000})
        await r.hset(NAMES.worker("fake"), mapping={"model": "m", "max_model_len": 4096})
        await r.expire(NAMES.worker("fake"), 15)

    async def _answer(self, rid: str) -> None:
        r = aioredis.Redis.from_url(self.url, socket_timeout=5)
        try:
            for events in [tokens(rid, range(s, s + 1)) for s in range(TOKENS)] + [[done(rid, TOKENS)]]:
                await asyncio.sleep(0.05)
                while not self.stopped:  # the explicit entry ids make a retry harmless, as for the real worker
                    try:
                        await emit(r, rid, events)
                        break
                    except (OSError, aioredis.ConnectionError, aioredis.TimeoutError, aioredis.ResponseError):
                        await asyncio.sleep(0.1)
        finally:
            await r.aclose()


async def ready(gw: Gateway) -> int:
    async with httpx.AsyncClient(timeout=5) as c:
        return (await c.get(gw.url + "readyz")).status_code


async def one_ws_request(gw: Gateway, rid: str) -> list[dict[str, Any]]:
    """A `/ws` request to its end: its events, or the error frame that refused it."""
    async with connect(gw.ws_url, open_timeout=5) as ws:
        await send(ws, {"type": "generate", "id": rid, "prompt": "x"})
        first = await recv(ws, timeout=10)
        if first["type"] == "error":
            return [first]
        events = []
        while not events or events[-1]["type"] not in ("done", "error"):
            events.append(await recv(ws, timeout=10))
        return events


async def one_sse_request(client: httpx.AsyncClient) -> int:
    """A streamed completion to its end; its status."""
    body = {"model": "m", "prompt": "x", "max_tokens": TOKENS, "stream": True}
    async with client.stream("POST", "v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            pass
        return resp.status_code


async def load(gw: Gateway, stop: asyncio.Event, outcomes: list[tuple[float, bool]]) -> None:
    """One client sending streamed completions back to back, recording when each ended and whether
    it was served whole."""
    async with httpx.AsyncClient(base_url=gw.url, timeout=20) as client:
        while not stop.is_set():
            try:
                ok = await one_sse_request(client) == 200
            except httpx.HTTPError:
                ok = False
            outcomes.append((time.monotonic(), ok))
            if not ok:
                await asyncio.sleep(0.1)


@pytest.mark.anyio
@pytest.mark.timeout(300)  # about a minute; a hang must not eat the CI's hour
async def test_the_gateway_serves_again_within_seconds_after_redis_restarts_under_load_twice() -> None:
    harness = asyncio.all_tasks()  # the test runner's own: never cancelled here
    try:
        with RedisServer(appendonly=True) as own:
            async with running_gateway(config(own.url, routing="shared")) as gw:
                fake = FakeWorker(own.url)
                worker = asyncio.create_task(fake.run())
                stop = asyncio.Event()
                outcomes: list[tuple[float, bool]] = []
                clients = [asyncio.create_task(load(gw, stop, outcomes)) for _ in range(200)]
                back = time.monotonic()
                try:
                    for restart in range(2):
                        # Streams in flight, subscriptions coming and going.
                        await _until(functools.partial(_served_since, outcomes, back), True, 30)
                        own.stop()
                        down = await _until(lambda: ready(gw), 503, 20)
                        assert down == 503, "/readyz must say the gateway cannot serve while Redis is away"
                        await asyncio.sleep(5)  # as long as the restart the gateway never recovered from
                        await asyncio.to_thread(own.start)
                        back = time.monotonic()
                        # Within seconds: ready again, and a fresh request through each API served whole.
                        await _until(lambda: ready(gw), 200, 15)
                        events = await asyncio.wait_for(one_ws_request(gw, f"after-{restart}"), 15)
                        assert [e["type"] for e in events] == ["token"] * TOKENS + ["done"], events
                        await _until(functools.partial(_served_since, outcomes, back), True, 15)
                    await asyncio.sleep(4)
                    settled = time.monotonic() - 3
                finally:
                    stop.set()
                    fake.stopped = True
                    for task in [*clients, worker, *fake.tasks]:
                        task.cancel()
                    # Not gather: a redis-py read cut by a cancel can outlive it for a while.
                    await asyncio.wait([*clients, worker], timeout=5)
    finally:
        # With Redis stopped, as when the event loop closes after the test.
        survivors = await _end_tasks_but(harness, within_s=30)
    assert not survivors, "tasks that outlived their first cancel: " + "\n\n".join(survivors)
    late = [ok for t, ok in outcomes if t > settled]
    assert late and all(late), f"{late.count(False)} of {len(late)} requests failed after the restarts"


async def _end_tasks_but(harness: set[asyncio.Task[Any]], within_s: float) -> list[str]:
    """Cancel every task the test started until they end. A task that survives a cancel (one swallowed
    somewhere below it) would hang the event loop's close forever, after the test: here it is named,
    with its stack, and cancelled again until it ends."""
    me = asyncio.current_task()
    survivors: dict[asyncio.Task[Any], str] = {}
    deadline = time.monotonic() + within_s
    first = True
    while time.monotonic() < deadline:
        tasks = [t for t in asyncio.all_tasks() if t is not me and t not in harness and not t.done()]
        if not tasks:
            break
        if not first:
            for t in tasks:
                survivors.setdefault(t, "".join(traceback.format_stack(t.get_stack()[-1]))
                                     if t.get_stack() else repr(t))
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=1)
        first = False
    return [f"{t.get_name()} {t.get_coro()!r}\n{stack}" for t, stack in survivors.items() if not t.done()] + \
        [f"(ended on a later cancel) {t.get_coro()!r}\n{stack}" for t, stack in survivors.items() if t.done()]


async def _served_since(outcomes: list[tuple[float, bool]], since: float) -> bool:
    return sum(1 for t, ok in outcomes if ok and t > since) >= 20


async def _until(probe: Any, want: Any, within_s: float) -> Any:
    """Probe until it answers `want`; TimeoutError after `within_s`. The deadline is checked here, not
    left to a wait_for cancel: a cancel landing inside an HTTP client's own timeout can come out as
    that client's timeout error, which this loop suppresses, and the test then waited forever."""
    deadline = time.monotonic() + within_s
    got = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            got = await probe()
            if got == want:
                return got
        await asyncio.sleep(0.2)
    raise TimeoutError(f"still {got!r} after {within_s} s, waiting for {want!r}")


def _silence_subscribes(pubsub: Any) -> Any:
    """A pub/sub whose SUBSCRIBE never reaches Redis, so nothing is ever confirmed on it: the
    connection seen wedged after Redis restarts under load."""
    async def silent(*channels: Any) -> None:
        await pubsub.connect()

    pubsub.subscribe = silent
    return pubsub


@pytest.mark.anyio
async def test_many_requests_on_a_wedged_pubsub_replace_it_once_and_all_go_on(redis_url: str) -> None:
    """Fifty requests waiting on a wedged connection at once: it is replaced once (each replacing it
    by itself dropped the others' confirmations, and the gateway stayed broken), and every one of
    them is accepted and streams live."""
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url, idle_poll_s=60.0)) as gw:
        _silence_subscribes(gw.hub.relay.pubsub)
        generation = gw.hub.relay.generation

        async def one(i: int) -> list[dict[str, Any]]:
            async with connect(gw.ws_url) as ws:
                await send(ws, {"type": "generate", "id": f"s{i}", "prompt": "x"})
                first = await recv(ws, timeout=20)
                assert first["type"] == "accepted", first
                await emit(r, f"s{i}", tokens(f"s{i}", range(0, 2)) + [done(f"s{i}", 2)])
                return [await recv(ws, timeout=10) for _ in range(3)]

        results = await asyncio.gather(*(one(i) for i in range(50)))
        assert all([e["type"] for e in events] == ["token", "token", "done"] for events in results)
        assert gw.hub.relay.generation == generation + 1
        assert await ready(gw) == 503  # no worker's heartbeat: never ready, but it must say why
    await r.aclose()


@pytest.mark.anyio
async def test_readyz_is_503_while_the_pubsub_cannot_confirm_subscriptions(redis_url: str) -> None:
    """Redis answers commands but no subscription is confirmed: the gateway cannot relay a single
    event, so it must not read as ready; it does again once a connection works."""
    async with running_gateway(config(redis_url, idle_poll_s=60.0)) as gw:
        await FakeWorker(redis_url)._beat(gw.hub.redis)
        assert await ready(gw) == 200
        make_pubsub = gw.hub.redis.pubsub
        gw.hub.redis.pubsub = lambda: _silence_subscribes(make_pubsub())  # every new connection wedged too
        _silence_subscribes(gw.hub.relay.pubsub)
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": "w1", "prompt": "x"})
            refused = await recv(ws, timeout=20)
            assert (refused["type"], refused["code"]) == ("error", "redis_unavailable"), refused
            status, body = await _readyz(gw)
            assert status == 503 and body["pubsub"] is False and body["redis"] is True, body
            gw.hub.redis.pubsub = make_pubsub
            await send(ws, {"type": "generate", "id": "w2", "prompt": "x"})
            assert (await recv(ws, timeout=20))["type"] == "accepted"
            await FakeWorker(redis_url)._beat(gw.hub.redis)  # the first beat is over 15 s old by now
            status, body = await _readyz(gw)
            assert status == 200 and body["pubsub"] is True, body


async def _readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=5) as c:
        resp = await c.get(gw.url + "readyz")
        return resp.status_code, resp.json()


# --- no stranded ids -----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_an_id_claimed_without_a_job_is_unknown_at_once_and_free_within_seconds(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway that claimed an id and died (or lost Redis) before pushing its job: a resume of the id
    is `unknown_request` at once (it used to wait with no frame at all), and a retry with the same id
    succeeds once the claim expires (it used to get `duplicate_id` for an hour)."""
    monkeypatch.setattr(hub_module, "CLAIM_TTL_MS", 1500)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws, \
            httpx.AsyncClient(base_url=gw.url + "v1", timeout=10) as http:
        for rid in ("d1", "d2"):
            assert await gw.hub.claim(rid) is not None  # the dead gateway's claim; no push follows
        await send(ws, {"type": "resume", "id": "d1", "after_seq": -1})
        refused = await recv(ws, timeout=5)
        assert (refused["type"], refused["code"]) == ("error", "unknown_request"), refused
        await send(ws, {"type": "cancel", "id": "d1"})
        assert (await recv(ws, timeout=5))["code"] == "unknown_request"
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        assert (await http.post("/completions", json=body, headers={"X-Request-Id": "d2"})).status_code == 409
        await asyncio.sleep(2)
        await send(ws, {"type": "generate", "id": "d1", "prompt": "x"})
        assert (await recv(ws))["type"] == "accepted"
        async with http.stream("POST", "/completions", json={**body, "stream": True},
                               headers={"X-Request-Id": "d2"}) as resp:
            assert resp.status_code == 200
        assert {job.id for job in await _jobs(gw)} == {"d1", "d2"}


@pytest.mark.anyio
async def test_a_push_that_fails_with_redis_leaves_the_id_free_for_the_retry(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The push fails and so does giving the claim back (Redis is away for both): the client's retry
    with the same id succeeds within seconds, and exactly one job exists."""
    monkeypatch.setattr(hub_module, "CLAIM_TTL_MS", 1500)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        real_push, real_release = gw.hub.push, gw.hub.release

        async def down(*args: Any) -> Any:
            raise aioredis.ConnectionError("Redis went away")

        gw.hub.push, gw.hub.release = down, down  # type: ignore[method-assign]
        await send(ws, {"type": "generate", "id": "f1", "prompt": "x"})
        assert (await recv(ws))["type"] == "accepted"  # sent once subscribed, just before the push
        assert (await recv(ws))["code"] == "redis_unavailable"
        gw.hub.push, gw.hub.release = real_push, real_release  # type: ignore[method-assign]
        await asyncio.sleep(2)
        await send(ws, {"type": "generate", "id": "f1", "prompt": "x"})
        assert (await recv(ws))["type"] == "accepted"
        # `accepted` goes out just before the push: give the push a moment to land.
        jobs = await _jobs(gw)
        for _ in range(250):
            if jobs:
                break
            await asyncio.sleep(0.02)
            jobs = await _jobs(gw)
        await asyncio.sleep(0.2)  # and then no second job may follow
        assert [job.id for job in await _jobs(gw)] == ["f1"]


@pytest.mark.anyio
async def test_the_push_checks_its_claim_in_the_same_script(redis_url: str) -> None:
    """Claim and push are one step: a push whose claim another request took over (it expired and was
    claimed again) is refused as `duplicate_id` and pushes nothing."""
    async with running_gateway(config(redis_url)) as gw:
        mine = await gw.hub.claim("c1")
        assert mine is not None
        await gw.hub.redis.set(NAMES.gateway_claim("c1"), "someone else's")
        with pytest.raises(ProtocolError) as refused:
            await gw.hub.push({"v": 1, "id": "c1", "prompt": "x"}, mine)
        assert refused.value.code == "duplicate_id"
        assert await _jobs(gw) == []
        assert not await gw.hub.redis.exists(NAMES.job("c1"))


async def _jobs(gw: Gateway) -> list[Any]:
    return [decode_job(fields) for _, fields in await gw.hub.redis.xrange(NAMES.requests)]
