"""Issue 13, bounded Redis: what clients can make Redis hold, and what finding workers costs.

- Workers are found through the heartbeat set, never by scanning keys: /healthz stays fast and right
  with 200k unrelated keys; stale members are pruned; a worker leaves the set when it stops.
- Consumers of crashed workers (nothing pending, idle for long) are deleted from the group.
Dead letters: test_dead_letters.py.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis_worker_helpers import running_worker, wait_for
from test_gateway import config, http_get

from clients.protocol import Names
from clients.redis_client import AsyncClient
from workers.gateway.server import running_gateway
from workers.heartbeats import STALE_MS, live_workers
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


def _now_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return seconds * 1000 + micros // 1000


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
            r.zadd(NAMES.heartbeats, {"crashed": _now_ms(r) - STALE_MS - 1000})
            r.hset(NAMES.worker("crashed"), mapping={"model": "x"})
            r.pexpire(NAMES.worker("crashed"), 60_000)
            assert [w["name"] for w in (await _health(gw.url))[1]["workers"]] == [name]
            await wait_for(lambda: r.zscore(NAMES.heartbeats, "crashed") is None, timeout=5)
            # A fresh member whose stats hash expired (it died between beats) is not listed either.
            r.zadd(NAMES.heartbeats, {"no-stats": _now_ms(r)})
            assert [w["name"] for w in (await _health(gw.url))[1]["workers"]] == [name]
            r.zrem(NAMES.heartbeats, "no-stats")
        # A worker that stops leaves the set (and its stats key) at once.
        assert not r.exists(NAMES.heartbeats) and not r.exists(NAMES.worker(name))
        status, body, _ = await _health(gw.url)
        assert status == 503 and body["workers"] == []
    called = _commands_called(r)
    assert not called & {"scan", "keys"}, called
    r.close()


# --- idle consumers --------------------------------------------------------------------------

def _consumers(r: redis.Redis) -> dict[str, int]:
    return {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(NAMES.requests, NAMES.group)}


@pytest.mark.anyio
async def test_idle_consumers_holding_nothing_are_deleted(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    for name in ("crashed-1", "crashed-2", "beating"):
        r.xgroup_createconsumer(NAMES.requests, NAMES.group, name)
    r.xadd(NAMES.requests, {"json": "{}"})
    r.xreadgroup(NAMES.group, "holder", {NAMES.requests: ">"}, count=1)  # holds an entry: never deleted
    r.zadd(NAMES.heartbeats, {"beating": _now_ms(r) + 60_000})  # alive, however idle: never deleted
    await anyio.sleep(0.4)
    r.xgroup_createconsumer(NAMES.requests, NAMES.group, "just-started")
    cfg = WorkerConfig(redis_url=redis_url, consumer_idle_s=0.3)
    async with aioredis.Redis.from_url(redis_url) as ar:
        reclaimer = Reclaimer(ar, cfg, WorkerState(lambda: 0), intake=None)  # type: ignore[arg-type]
        assert sorted(await reclaimer.drop_idle_consumers()) == ["crashed-1", "crashed-2"]
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
