"""Issue 13, bounded Redis: what clients can make Redis hold, and what finding workers costs.

- Workers are found through the heartbeat set, never by scanning keys: /healthz stays fast and right
  with 200k unrelated keys; stale members are pruned; a worker leaves the set when it stops.
- A cancel creates a key only for a request that exists (gateway frame and Python client).
- Consumers of crashed workers (nothing pending, idle for long) are deleted from the group.
Dead letters: test_dead_letters.py.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis_worker_helpers import redis_now_ms, running_worker, wait_for
from test_gateway import _cancels, _drain_cancels, config, http_get, recv, send
from websockets.asyncio.client import connect

from clients.errors import UnknownRequest
from clients.heartbeats import STALE_MS, live_workers
from clients.protocol import Names
from clients.redis_client import KEY_TTL_MS, AsyncClient, Client
from workers.gateway.server import running_gateway
from workers.worker.config import WorkerConfig
from workers.worker.reclaim import Reclaimer
from workers.worker.state import WorkerState

NAMES = Names()
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

# Fills the database with `n` small keys in one round trip (no DEBUG POPULATE: off by default in Redis 7).
_POPULATE = """
for i = 1, tonumber(ARGV[1]) do
  redis.call('SET', ARGV[2] .. i, 'x')
end
return redis.call('DBSIZE')
"""


def _commands_called(r: redis.Redis) -> set[str]:
    return {k.removeprefix("cmdstat_") for k in r.info("commandstats")}


async def _health(url: str) -> tuple[int, dict, float]:
    start = time.perf_counter()
    status, _, body = await http_get(url + "healthz")
    return status, json.loads(body), time.perf_counter() - start


# --- worker discovery ------------------------------------------------------------------------

@pytest.mark.anyio
async def test_healthz_reads_the_heartbeat_set_not_the_keyspace(llama_ckpt: Path, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    assert r.eval(_POPULATE, 0, 200_000, "junk:") == 200_000
    # Stale stats hashes under the workers' key pattern: a scan would have found these.
    for i in range(50):
        r.hset(NAMES.worker(f"ghost-{i}"), mapping={"model": "gone"})
    r.config_resetstat()
    async with running_gateway(config(redis_url)) as gw:
        status, body, _ = await _health(gw.url)
        assert status == 503 and body["workers"] == [] and body["redis"] is True
        async with running_worker(llama_ckpt, redis_url) as worker:
            name = worker.cfg.consumer
            await wait_for(lambda: set(live_workers(r, NAMES)) == {name}, timeout=5)  # its first beat
            status, body, _ = await _health(gw.url)
            assert status == 200 and [w["name"] for w in body["workers"]] == [name]
            assert body["workers"][0]["model"] == str(llama_ckpt)
            times = [(await _health(gw.url))[2] for _ in range(20)]
            # A scan of 200k keys took ~0.6 s here; two small commands take a few ms (plus HTTP).
            assert statistics.median(times) < 0.25, times

            # A member that stopped beating is not listed, and the next beat of any worker prunes it.
            r.zadd(NAMES.heartbeats, {"crashed": redis_now_ms(r) - STALE_MS - 1000})
            r.hset(NAMES.worker("crashed"), mapping={"model": "x"})
            r.pexpire(NAMES.worker("crashed"), 60_000)
            assert [w["name"] for w in (await _health(gw.url))[1]["workers"]] == [name]
            await wait_for(lambda: r.zscore(NAMES.heartbeats, "crashed") is None, timeout=5)
            # A fresh member whose stats hash expired (it died between beats) is not listed either.
            r.zadd(NAMES.heartbeats, {"no-stats": redis_now_ms(r)})
            assert [w["name"] for w in (await _health(gw.url))[1]["workers"]] == [name]
            r.zrem(NAMES.heartbeats, "no-stats")
        # A worker that stops leaves the set (and its stats key) at once.
        assert not r.exists(NAMES.heartbeats) and not r.exists(NAMES.worker(name))
        status, body, _ = await _health(gw.url)
        assert status == 503 and body["workers"] == []
    called = _commands_called(r)
    assert not called & {"scan", "keys"}, called
    r.close()


# --- cancels ---------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_gateway_cancel_of_an_unknown_id_creates_nothing(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    pubsub = await _cancels(r)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        before = await r.dbsize()
        for i in range(500):
            await send(ws, {"type": "cancel", "id": f"made-up-{i}"})
        for i in range(500):
            frame = await recv(ws)
            assert frame["type"] == "error" and frame["code"] == "unknown_request", frame
            assert frame["id"] == f"made-up-{i}" and "made-up" in frame["message"]
        assert await r.dbsize() == before  # not one key for 500 made-up ids
        assert await _drain_cancels(pubsub, 0.3) == []  # and no worker was bothered
        # A request that exists (queued, no worker yet) is cancelled as before.
        await send(ws, {"type": "generate", "id": "real", "prompt": "x"})
        assert (await recv(ws))["type"] == "accepted"
        with anyio.fail_after(5):  # `accepted` may come just before the push
            while (owner := await r.get(NAMES.job("real"))) is None:  # the push records the id's owner
                await anyio.sleep(0.02)
        assert [e for e, _ in await r.xrange(NAMES.requests)] == [owner]
        await send(ws, {"type": "cancel", "id": "real"})
        assert await _drain_cancels(pubsub, 1.0) == ["real"]
        assert 0 < await r.pttl(NAMES.cancelled("real")) <= 3_600_000
    await pubsub.aclose()
    await r.aclose()


@pytest.mark.anyio
async def test_client_cancel_of_an_unknown_id_raises_and_creates_nothing(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    pubsub = await _cancels(r)
    async with AsyncClient(redis_url) as client:
        with pytest.raises(UnknownRequest) as info:
            await client.cancel("never-submitted")
        assert info.value.code == "unknown_request" and info.value.request_id == "never-submitted"
        assert await r.dbsize() == 0 and await _drain_cancels(pubsub, 0.2) == []
        # Submitted and still queued (no worker): the id exists from the push on, and can be cancelled.
        rid = await client.submit("x", params=GREEDY)
        (entry, _), = await r.xrange(NAMES.requests)
        assert await r.get(NAMES.job(rid)) == entry and 0 < await r.pttl(NAMES.job(rid)) <= KEY_TTL_MS
        await client.cancel(rid)
        assert await r.exists(NAMES.cancelled(rid)) and await _drain_cancels(pubsub, 1.0) == [rid]
        # A second job with the same id does not take the id over (the worker refuses it as a duplicate).
        await client.submit("y", id=rid, params=GREEDY)
        assert await r.get(NAMES.job(rid)) == entry and await r.xlen(NAMES.requests) == 2

    def blocking() -> None:
        with Client(redis_url) as sync_client, pytest.raises(UnknownRequest):
            sync_client.cancel("also-made-up")

    await anyio.to_thread.run_sync(blocking)
    assert not await r.exists(NAMES.cancelled("also-made-up"))
    await pubsub.aclose()
    await r.aclose()


# --- idle consumers --------------------------------------------------------------------------

def _consumers(r: redis.Redis) -> dict[str, int]:
    return {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(NAMES.requests, NAMES.group)}


@pytest.mark.anyio
async def test_idle_consumers_holding_nothing_are_deleted(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """In every request stream (the shared one and the workers' own); the log names the first ten."""
    caplog.set_level(logging.INFO, logger="streamer.worker")
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    crashed = [f"crashed-{i}" for i in range(1, 11)]
    for name in (*crashed, "beating"):
        r.xgroup_createconsumer(NAMES.requests, NAMES.group, name)
    elsewhere = NAMES.worker_requests("other")  # a worker's own stream, with a crashed reader of its own
    r.zadd(NAMES.worker_streams, {"other": redis_now_ms(r)})
    r.xgroup_create(elsewhere, NAMES.group, id="0", mkstream=True)
    r.xgroup_createconsumer(elsewhere, NAMES.group, "crashed-elsewhere")
    r.xadd(NAMES.requests, {"json": "{}"})
    r.xreadgroup(NAMES.group, "holder", {NAMES.requests: ">"}, count=1)  # holds an entry: never deleted
    r.zadd(NAMES.heartbeats, {"beating": redis_now_ms(r) + 60_000})  # alive, however idle: never deleted
    await anyio.sleep(0.4)
    r.xgroup_createconsumer(NAMES.requests, NAMES.group, "just-started")
    cfg = WorkerConfig(redis_url=redis_url, consumer_idle_s=0.3)
    async with aioredis.Redis.from_url(redis_url) as ar:
        reclaimer = Reclaimer(ar, cfg, WorkerState(lambda: 0), intake=None)  # type: ignore[arg-type]
        removed = await reclaimer.drop_idle_consumers()
    assert removed == sorted([*crashed, "crashed-elsewhere"])
    assert [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("removed")] == [
        f"removed 11 idle consumer(s) holding no job from group {NAMES.group}: {', '.join(removed[:10])} ..."]
    assert not r.xinfo_consumers(elsewhere, NAMES.group)
    assert _consumers(r) == {"holder": 1, "beating": 0, "just-started": 0}
    r.close()


@pytest.mark.anyio
async def test_a_running_worker_clears_crashed_consumers(llama_ckpt: Path, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    for i in range(20):  # what 20 crashed restarts leave behind
        r.xgroup_createconsumer(NAMES.requests, NAMES.group, f"crashed-{i}")
    async with running_worker(llama_ckpt, redis_url, claim_idle_s=0.5, consumer_idle_s=0.6) as worker, \
            AsyncClient(redis_url) as client:
        await wait_for(lambda: not _consumers(r), timeout=15)
        await client.generate("hi", params=GREEDY, timeout=30)  # the worker's own consumer reads it
        assert set(_consumers(r)) == {worker.cfg.consumer}
        # Idle past the bound between its blocking reads (1 s), but beating: never deleted.
        await anyio.sleep(2.0)
        assert set(_consumers(r)) == {worker.cfg.consumer}
    r.close()
