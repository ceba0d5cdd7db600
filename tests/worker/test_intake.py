"""Job intake (workers/worker/intake.py) at its edges: Redis refusing a read (a key of the wrong type,
a consumer group lost), a burst gathered into one batch, sharded request streams on a single Redis and
on a cluster (one reader per shard), and keys of a request that someone else wrote. The engine is
scripted (tests/scripted_engine.py); Redis and the worker are real."""

from __future__ import annotations

import logging
import time

import anyio
import pytest
import redis
from redis_worker_helpers import check_complete, dead_letters, has_ended, read_events, wait_for
from scripted_engine import ScriptedEngine, answer, scripted_worker

from clients.protocol import Names
from clients.redis_client import AsyncClient

NAMES = Names()
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def ended(url: str, *ids: str, names: Names = NAMES) -> bool:
    return all(has_ended(url, rid, names) for rid in ids)


@pytest.mark.anyio
async def test_a_read_redis_refuses_is_logged_and_retried(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The fair-share clock is a string (someone's key): every take fails with WRONGTYPE. The worker
    stays up, says why, and serves the job once the key is fixed."""
    caplog.set_level(logging.INFO, logger="streamer.worker")
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({"p": [answer()]})
    async with scripted_worker(engine, redis_url) as worker, AsyncClient(redis_url) as client:
        r.set(NAMES.service, "not a hash")
        await client.submit("p", id="waits", params=GREEDY)
        await wait_for(lambda: any("read: Redis refused: " in m for m in caplog.messages), timeout=10)
        assert not worker.stopping and engine.calls == []
        r.delete(NAMES.service)
        await wait_for(lambda: ended(redis_url, "waits"), timeout=10)
    assert check_complete(read_events(redis_url, "waits"))["type"] == "done"
    assert not any("consumer group missing" in m for m in caplog.messages)
    r.close()


@pytest.mark.anyio
async def test_a_lost_group_on_a_shard_is_made_again(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Over two shards (one XREADGROUP over both): Redis loses the group of one (a restart without its
    data, a FLUSHALL); the worker makes it again and serves what comes there next."""
    caplog.set_level(logging.INFO, logger="streamer.worker")
    names = Names(shards=2)
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({"p": [answer()]})
    ids = [f"job-{i}" for i in range(6)]  # over both shards
    assert {names.stream_for(rid) for rid in ids} == set(names.request_streams)
    async with scripted_worker(engine, redis_url, names=names, block_ms=100) as worker, \
            AsyncClient(redis_url, names=names) as client:
        for rid in ids[:3]:
            await client.submit("p", id=rid, params=GREEDY)
        await wait_for(lambda: ended(redis_url, *ids[:3], names=names), timeout=10)
        r.xgroup_destroy(names.request_streams[0], names.group)
        await wait_for(lambda: any("consumer group missing" in m for m in caplog.messages), timeout=10)
        for rid in ids[3:]:
            await client.submit("p", id=rid, params=GREEDY)
        await wait_for(lambda: ended(redis_url, *ids[3:], names=names), timeout=10)
        assert not worker.stopping
    assert sorted(c.request_id for c in engine.calls) == ids
    assert "consumer group missing (Redis lost its data?): creating it again" in caplog.messages
    assert not [m for m in caplog.messages if "Redis refused" in m]
    r.close()


@pytest.mark.anyio
async def test_each_shard_of_a_cluster_has_its_reader(one_node_cluster_url: str) -> None:
    names = Names(shards=2, cluster=True)
    engine = ScriptedEngine({"p": [answer()]})
    ids = [f"job-{i}" for i in range(6)]
    async with scripted_worker(engine, one_node_cluster_url, names=names, block_ms=100), \
            AsyncClient(one_node_cluster_url, names=names) as client:
        for rid in ids:
            await client.submit("p", id=rid, params=GREEDY)
        await wait_for(lambda: ended(one_node_cluster_url, *ids, names=names), timeout=15)
    assert sorted(c.request_id for c in engine.calls) == ids


@pytest.mark.anyio
async def test_a_burst_enters_the_engine_together(redis_url: str) -> None:
    """A job read alone waits `read_linger_ms` for the rest of its burst: one pushed 0.3 s later still
    enters the engine with it, not 0.3 s after."""
    engine = ScriptedEngine({"p": [answer()]})
    async with scripted_worker(engine, redis_url, read_linger_ms=800), AsyncClient(redis_url) as client:
        pushed = time.monotonic()
        await client.submit("p", id="first", params=GREEDY)
        await anyio.sleep(0.3)
        await client.submit("p", id="second", params=GREEDY)
        await wait_for(lambda: ended(redis_url, "first", "second"), timeout=10)
    first, second = sorted(engine.calls, key=lambda c: c.at)
    assert first.at - pushed >= 0.7  # it waited for the burst
    assert second.at - first.at < 0.15, second.at - first.at


@pytest.mark.anyio
async def test_a_request_whose_keys_someone_else_wrote_is_left_alone(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.set(NAMES.events("squatted"), "a string where its events belong")
    engine = ScriptedEngine({"p": [answer()]})
    async with scripted_worker(engine, redis_url), AsyncClient(redis_url) as client:
        await client.submit("p", id="squatted", params=GREEDY)
        await client.submit("p", id="fine", params=GREEDY)
        await wait_for(lambda: ended(redis_url, "fine") and len(dead_letters(redis_url)) == 1, timeout=10)
    [letter] = dead_letters(redis_url)
    assert letter["reason"] == b"damaged_events" and "id" not in letter  # nothing written under its id
    assert letter["message"].startswith(b"keys of 'squatted': ") and b"WRONGTYPE" in letter["message"]
    assert r.get(NAMES.events("squatted")) == b"a string where its events belong"
    assert [c.request_id for c in engine.calls] == ["fine"]
    r.close()
