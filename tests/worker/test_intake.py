"""Job intake (workers/worker/intake.py) at its edges: Redis refusing a read (a key of the wrong type,
a consumer group lost), a burst gathered into one batch, sharded request streams on a single Redis and
on a cluster (one reader per shard), and keys of a request that someone else wrote. The engine is
scripted (tests/scripted_engine.py); Redis and the worker are real."""

from __future__ import annotations

import logging
import re
import time

import anyio
import pytest
import redis
import redis.asyncio as aioredis
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
    # What Redis said, whole (the take script's WRONGTYPE names the script and its line).
    assert any(re.fullmatch(r"read: Redis refused: WRONGTYPE Operation against a key holding the wrong kind of value "
                            r"script: \w+, on @user_script:\d+\.", m) for m in caplog.messages)
    # The read's backoff says what failed, and when reads work again, under its own name.
    assert any(m.startswith("read: Redis unavailable (ResponseError: WRONGTYPE") for m in caplog.messages)
    assert any(re.fullmatch(r"read: Redis reachable again after \d+ failed attempt\(s\)", m) for m in caplog.messages)
    r.close()


async def _drop_blocked_reads(r: aioredis.Redis) -> None:
    """CLIENT KILL each connection blocked in XREADGROUP (the worker's read waiting for a job)."""
    for client in await r.client_list():
        if client["cmd"] == "xreadgroup" and "b" in client["flags"]:
            await r.client_kill_filter(_id=client["id"])


@pytest.mark.anyio
async def test_a_read_whose_connection_keeps_dropping_is_retried(redis_url: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The worker's waiting read loses its connection again and again (redis-py's own retries run out):
    the read loop backs off, says why, and serves the next job once reads go through."""
    caplog.set_level(logging.INFO, logger="streamer.worker")
    engine = ScriptedEngine({"p": [answer()]})
    r = aioredis.Redis.from_url(redis_url)
    async with scripted_worker(engine, redis_url, block_ms=2000), AsyncClient(redis_url) as client:
        with anyio.fail_after(10):
            while not any(m.startswith("read: Redis unavailable (ConnectionError") for m in caplog.messages):
                await _drop_blocked_reads(r)
                await anyio.sleep(0.005)
        await client.submit("p", id="after", params=GREEDY)
        await wait_for(lambda: ended(redis_url, "after"), timeout=10)
    await r.aclose()
    assert [c.request_id for c in engine.calls] == ["after"]
    assert any(m.startswith("read: Redis reachable again after ") for m in caplog.messages)


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
        # Served as read (not seconds later by the reclaimer, claim_idle_s 5) and acked where they were read.
        await wait_for(lambda: ended(redis_url, *ids[:3], names=names), timeout=3)
        await wait_for(lambda: sum(r.xpending(s, names.group)["pending"] for s in names.request_streams) == 0,
                       timeout=2)
        r.xgroup_destroy(names.request_streams[0], names.group)
        await wait_for(lambda: any("consumer group missing" in m for m in caplog.messages), timeout=10)
        for rid in ids[3:]:
            await client.submit("p", id=rid, params=GREEDY)
        await wait_for(lambda: ended(redis_url, *ids[3:], names=names), timeout=10)
        assert not worker.stopping
        # Idle, the read over both shards blocks for block_ms (100 ms): a few reads in half a second.
        r.config_resetstat()
        await anyio.sleep(0.5)
        assert r.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0) <= 20
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
async def test_the_readers_of_a_clusters_shards_share_the_engines_room(one_node_cluster_url: str) -> None:
    """Six jobs wait in each of two shards when the worker starts; the engine admits eight. Each shard's
    reader takes its half (four), not eight. One may read again before the other's four are counted
    (half of what it sees left: two), so at most ten enter before the first are admitted (1.5 s after
    they entered); a reader taking the whole room would take its shard's six, twelve in all."""
    names = Names(shards=2, cluster=True)
    engine = ScriptedEngine({"p": [[1.5, *answer()]]})
    ids = [f"job-{i:02d}" for i in range(12)]
    assert [sum(names.stream_for(rid) == s for rid in ids) for s in names.request_streams] == [6, 6]
    async with AsyncClient(one_node_cluster_url, names=names) as client:
        for rid in ids:
            await client.submit("p", id=rid, params=GREEDY)
        async with scripted_worker(engine, one_node_cluster_url, names=names, block_ms=100):
            await wait_for(lambda: len(engine.calls) >= 8, timeout=10)
            await anyio.sleep(0.5)
            assert len(engine.calls) <= 10
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
    assert second.at - first.at < 0.5, second.at - first.at  # not read apart: that would be 0.3 s + 0.8 s


@pytest.mark.anyio
async def test_a_full_read_enters_the_engine_at_once(redis_url: str) -> None:
    """Eight jobs waiting when the worker starts fill its first read (the engine admits eight): that
    read has no burst to wait for, so none of them waits `read_linger_ms`."""
    engine = ScriptedEngine({"p": [answer()]})
    ids = [f"job-{i}" for i in range(8)]
    async with AsyncClient(redis_url) as client:
        for rid in ids:
            await client.submit("p", id=rid, params=GREEDY)
        async with scripted_worker(engine, redis_url, read_linger_ms=2000):
            ready = time.monotonic()
            await wait_for(lambda: ended(redis_url, *ids), timeout=10)
    assert sorted(c.request_id for c in engine.calls) == ids
    assert max(c.at for c in engine.calls) - ready < 1.5  # a linger would make it 2 s


@pytest.mark.anyio
async def test_an_idle_worker_waits_for_a_burst_only_after_reading_a_job(redis_url: str) -> None:
    """Reads that find nothing are not followed by `read_linger_ms`: a job pushed while the worker idles
    is read at once by the waiting read and then waits the linger for the rest of its burst, the
    second one as the first (a linger after each empty read would pick it up early, at its end)."""
    engine = ScriptedEngine({"p": [answer()]})
    waits = []
    async with scripted_worker(engine, redis_url, read_linger_ms=1000, block_ms=50), \
            AsyncClient(redis_url) as client:
        for rid in ("one", "two"):
            await anyio.sleep(0.5)  # idle: reads that find nothing
            pushed = time.monotonic()
            await client.submit("p", id=rid, params=GREEDY)
            await wait_for(lambda rid=rid: ended(redis_url, rid), timeout=10)
            waits.append(engine.calls[-1].at - pushed)
    assert [c.request_id for c in engine.calls] == ["one", "two"]
    assert min(waits) >= 0.9, waits


@pytest.mark.anyio
async def test_the_rest_of_a_burst_is_read_only_up_to_the_engines_room(redis_url: str) -> None:
    """A job read alone waits for its burst; nine more arrive meanwhile. The engine admits eight, one of
    them taken: the read at the end of the linger takes seven, the last two wait until the first jobs
    are admitted (each is, at its first output, 1.5 s after it entered)."""
    engine = ScriptedEngine({"p": [[1.5, *answer()]]})
    ids = [f"job-{i}" for i in range(10)]
    async with scripted_worker(engine, redis_url, read_linger_ms=500), AsyncClient(redis_url) as client:
        await client.submit("p", id=ids[0], params=GREEDY)
        await anyio.sleep(0.15)
        for rid in ids[1:]:
            await client.submit("p", id=rid, params=GREEDY)
        await wait_for(lambda: len(engine.calls) >= 8, timeout=10)
        await anyio.sleep(0.5)  # still before the first of them is admitted
        assert len(engine.calls) == 8
        await wait_for(lambda: ended(redis_url, *ids), timeout=15)
    assert sorted(c.request_id for c in engine.calls) == sorted(ids)


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
