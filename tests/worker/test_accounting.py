"""What a worker's accounting writes to Redis in one flush (workers/worker/accounting.py): its stream's
registration, its load (not the sessions it serves: those are written when a job is taken, see
test_raw_routing.py), the tenants' slots it frees, the charges, its
advertised prefixes (added, dropped, expiring, written whole again), and what leaving removes. Real
redis-server; the engine is stood in for by its two numbers (KV capacity, jobs held). The charge
correction at its boundaries is in test_serving_boundaries.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_faults import drop_connections, writes_held

from clients.names import Names
from clients.protocol import Job
from clients.routing import Segment, answer_chain, prefix_chain
from workers.worker import accounting
from workers.worker.accounting import FLUSH_S, Accounting, PrefixAdvert
from workers.worker.streams import NO_TENANT

NAMES = Names()
ME = "w-1"
TTL_MS = 60_000
CHAT = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "u" * 400}]


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def make(r: aioredis.Redis, capacity: int = 10_000, held: int = 0) -> Accounting:
    return Accounting(r, NAMES, ME, TTL_MS, capacity=lambda: capacity, held=lambda: held)


async def advertised(r: aioredis.Redis) -> set[str]:
    return {d.decode() for d in await r.smembers(NAMES.worker_prefixes(ME))}


@pytest.mark.anyio
async def test_a_flush_registers_the_worker_and_its_load(r: aioredis.Redis) -> None:
    acc = make(r, held=3)
    acc.started(Job("j1", "json", messages=CHAT, session="chat-1"))
    seconds, _ = await r.time()
    await acc.flush()
    score = await r.zscore(NAMES.worker_streams, ME)
    assert score is not None and abs(score / 1000 - seconds) < 60  # when it last flushed, in ms
    assert await r.hget(NAMES.loads, ME) == b"3"
    # A session's worker is written when its job is taken (affinity.py): a flush a moment later would
    # take the session back from a worker that took its next call meanwhile.
    assert await r.keys(f"{NAMES.prefix}:session:*") == []


@pytest.mark.anyio
async def test_a_finished_tenant_job_frees_its_slot_and_the_untenanted_are_charged_apart(r: aioredis.Redis) -> None:
    await r.zadd(NAMES.tenant_active("acme"), {"j1": 1, "j2": 1})
    acc = make(r)
    acc.finished(Job("j1", "json", prompt="x", tenant="acme"), 10, "acme", 0.0, None)
    acc.finished(Job("j3", "json", prompt="x"), 7, NO_TENANT, 0.0, None)
    await acc.flush()
    assert await r.zrange(NAMES.tenant_active("acme"), 0, -1) == [b"j2"]
    assert await r.hgetall(NAMES.service) == {b"acme": b"10", NO_TENANT.encode(): b"7"}


@pytest.mark.anyio
async def test_prefixes_are_advertised_dropped_and_expire(r: aioredis.Redis) -> None:
    job = Job("j1", "json", messages=CHAT)
    chain = prefix_chain({"messages": CHAT})
    acc = make(r)
    acc.started(job)
    await acc.flush()
    assert await advertised(r) == {s.digest for s in chain}
    assert TTL_MS - 5_000 < await r.pttl(NAMES.worker_prefixes(ME)) <= TTL_MS
    # The answer extends the chain: the next turn, as the client will send it, is held too.
    acc.finished(job, 5, NO_TENANT, 0.0, "the answer")
    await acc.flush()
    assert await advertised(r) == {s.digest for s in answer_chain({"messages": CHAT}, "the answer")}
    # A cache too small for the chain's tail: its last segments go first, from Redis too.
    small = make(r, capacity=chain[0].tokens)
    small.started(job)
    await small.flush()
    assert await advertised(r) == {chain[0].digest}


@pytest.mark.anyio
async def test_the_whole_set_is_written_again_after_a_while(r: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """In case its key was lost (expired while the worker was stalled, a flushed database)."""
    acc = make(r)
    acc.started(Job("j1", "json", messages=CHAT))
    await acc.flush()
    await r.delete(NAMES.worker_prefixes(ME))
    await acc.flush()  # nothing new to add and not time yet: still gone
    assert await advertised(r) == set()
    monkeypatch.setattr(accounting, "REWRITE_S", 0.0)
    await acc.flush()
    assert await advertised(r) == {s.digest for s in prefix_chain({"messages": CHAT})}


@pytest.mark.anyio
async def test_charges_survive_a_server_that_forgot_its_scripts(r: aioredis.Redis) -> None:
    acc = make(r)
    acc.finished(Job("j1", "json", prompt="x", tenant="acme"), 12, NO_TENANT, 256.0, None)
    await r.script_flush()  # a fresh or restarted node: the charge script must be loaded again
    await acc.flush()
    assert await r.hget(NAMES.service, "acme") == b"12"
    acc.finished(Job("j2", "json", prompt="x", tenant="acme"), 3, NO_TENANT, 256.0, None)
    await acc.flush()
    assert await r.hget(NAMES.service, "acme") == b"15"


@pytest.mark.anyio
async def test_charges_land_once_on_a_cluster_node_without_the_script(one_node_cluster_url: str) -> None:
    """On a cluster the charge goes as a plain EVALSHA (a cluster pipeline loads no script): a fresh
    node answers NOSCRIPT, and the worker loads the script and charges again, each job once, divided
    by its tenant's share; the rest of the flush has landed meanwhile."""
    cluster = Names(cluster=True)
    rc = aioredis.RedisCluster.from_url(one_node_cluster_url)
    try:
        await rc.hset(cluster.tenants, "acme", 2)
        await rc.zadd(cluster.tenant_active("acme"), {"j1": 1})
        acc = Accounting(rc, cluster, ME, TTL_MS, held=lambda: 1)
        acc.finished(Job("j1", "json", prompt="x", tenant="acme"), 12, NO_TENANT, 256.0, None)
        acc.finished(Job("j2", "json", prompt="x"), 7, NO_TENANT, 0.0, None)
        await acc.flush()
        assert await rc.hgetall(cluster.service) == {b"acme": b"6", NO_TENANT.encode(): b"7"}
        assert await rc.zcard(cluster.tenant_active("acme")) == 0 and await rc.hget(cluster.loads, ME) == b"1"
        acc.finished(Job("j3", "json", prompt="x", tenant="acme"), 4, NO_TENANT, 256.0, None)
        await acc.flush()  # the script is there now: charged in the flush itself
        assert await rc.hget(cluster.service, "acme") == b"8"
    finally:
        await rc.aclose()


@pytest.mark.anyio
async def test_leaving_removes_the_advert_and_the_load(r: aioredis.Redis) -> None:
    acc = make(r, held=2)
    acc.started(Job("j1", "json", messages=CHAT))
    await acc.flush()
    await r.hset(NAMES.loads, "w-2", 1)
    await acc.leave()
    assert not await r.exists(NAMES.worker_prefixes(ME))
    assert await r.hgetall(NAMES.loads) == {b"w-2": b"1"}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.anyio
@pytest.mark.parametrize("job", [
    Job("j", "json", prompt="p" * 600), Job("j", "json", prompt_token_ids=list(range(130))),
    Job("j", "json", messages=CHAT, tools=TOOLS)], ids=["prompt", "token ids", "chat with tools"])
async def test_every_kind_of_input_is_advertised_as_the_router_hashes_it(r: aioredis.Redis, job: Job) -> None:
    acc = make(r)
    acc.started(job)
    await acc.flush()
    want = prefix_chain({"messages": job.messages, "tools": job.tools, "prompt": job.prompt,
                         "prompt_token_ids": job.prompt_token_ids})
    assert want and await advertised(r) == {s.digest for s in want}


def chain(tokens: list[int], tag: str) -> list[Segment]:
    """A chain whose segments hold these cumulative token counts."""
    return [Segment(f"{tag}{i}", t) for i, t in enumerate(tokens)]


def test_the_advert_holds_exactly_its_capacity_in_tokens() -> None:
    a = chain([10, 25, 45], "a")  # segments of 10, 15 and 20 tokens
    full = PrefixAdvert(lambda: 45)
    full.add(a)
    assert full.digests == ["a2", "a1", "a0"] and full.added == {"a0", "a1", "a2"}
    short = PrefixAdvert(lambda: 44)  # one token short: the tail goes, the root stays
    short.add(a)
    assert short.digests == ["a1", "a0"] and short.added == {"a0", "a1"} and short.removed == {"a2"}
    root = PrefixAdvert(lambda: 10)
    root.add(a)
    assert root.digests == ["a0"]


def test_a_chain_served_again_is_the_most_recent_whole() -> None:
    capacity = [100]
    advert = PrefixAdvert(lambda: capacity[0])
    a, b = chain([10, 20, 30, 40], "a"), chain([10, 20], "b")
    advert.add(a[:2])
    advert.add(b)
    advert.add(a)  # its first two segments are held already: refreshed, not skipped
    assert advert.digests == ["b1", "b0", "a3", "a2", "a1", "a0"]
    capacity[0] = 40
    advert.add([])  # shrunk: the least recently used go, b before any of a
    assert advert.digests == ["a3", "a2", "a1", "a0"] and advert.removed == {"b0", "b1"}
    advert.add(b)  # back: no longer to be removed
    assert "b0" in advert.added and "b0" not in advert.removed


@pytest.mark.anyio
async def test_what_is_dropped_leaves_redis_and_what_never_went_out_never_does(r: aioredis.Redis) -> None:
    capacity = [100]
    acc = Accounting(r, NAMES, ME, TTL_MS, capacity=lambda: capacity[0])
    acc.prefixes.add(chain([10, 20], "a"))
    await acc.flush()
    acc.prefixes.add(chain([10, 20], "b"))  # never flushed ...
    capacity[0] = 20
    acc.prefixes.add(chain([10, 20], "c"))  # ... and dropped again, with a
    await acc.flush()
    assert await advertised(r) == {"c0", "c1"}


@pytest.mark.anyio
async def test_a_refused_write_does_not_stop_the_rest_of_the_flush(r: aioredis.Redis) -> None:
    await r.set(NAMES.tenant_active("acme"), "not a sorted set")
    acc = make(r, held=1)
    acc.finished(Job("j1", "json", prompt="x", tenant="acme"), 10, "acme", 0.0, None)
    await acc.flush()
    assert await r.hget(NAMES.service, "acme") == b"10" and await r.hget(NAMES.loads, ME) == b"1"


@pytest.mark.anyio
async def test_what_a_failed_flush_held_goes_out_with_the_next(r: aioredis.Redis) -> None:
    capacity = [100]
    acc = Accounting(r, NAMES, ME, TTL_MS, capacity=lambda: capacity[0])
    acc.prefixes.add(chain([10, 20], "a"))
    await acc.flush()  # the whole set is written: the next flushes send only what changed
    acc.finished(Job("j1", "json", prompt="x", tenant="acme"), 10, "acme", 0.0, None)
    await r.zadd(NAMES.tenant_active("acme"), {"j1": 1})
    capacity[0] = 20
    acc.prefixes.add(chain([10, 20], "c"))  # c in, a out
    acc.redis = unreachable()
    with pytest.raises(RedisConnectionError):
        await acc.flush()
    await acc.redis.aclose()
    acc.redis = r
    await acc.flush()
    assert await r.hget(NAMES.service, "acme") == b"10" and not await r.exists(NAMES.tenant_active("acme"))
    assert await advertised(r) == {"c0", "c1"}


ACCOUNTING = "accounting-under-test"  # CLIENT SETNAME of its connection, to drop it


@pytest.mark.anyio
async def test_what_jobs_record_while_a_flush_is_out_survives_its_failure(r: aioredis.Redis, redis_url: str) -> None:
    """Job tasks go on recording while a flush's round trip is out. When that round trip is lost (a
    dropped connection), what it carried and what was recorded meanwhile both go out with the next
    flush: no charge or freed slot lost, and the advert ends as the cache is (what was dropped
    during the failed round trip leaves Redis, what was added meanwhile is there)."""
    capacity = [100]
    named = aioredis.Redis.from_url(redis_url, client_name=ACCOUNTING, retry=Retry(NoBackoff(), 0))
    acc = Accounting(named, NAMES, ME, TTL_MS, capacity=lambda: capacity[0])
    acc.prefixes.add(chain([10, 20], "a"))
    acc.prefixes.add(chain([10, 20], "b"))
    await acc.flush()  # the whole set is written: the next flushes send only what changed
    await r.zadd(NAMES.tenant_active("acme"), {"j1": 1, "j2": 1})
    acc.finished(Job("j1", "json", prompt="x", tenant="acme"), 10, "acme", 0.0, None)
    capacity[0] = 40
    acc.prefixes.add(chain([10, 20], "c"))  # c in, a out: this flush's change
    with anyio.fail_after(10):
        async with writes_held(r), anyio.create_task_group() as tg:
            tg.start_soon(flush_failing, acc)
            await anyio.wait_all_tasks_blocked()  # its round trip waits at Redis
            acc.finished(Job("j2", "json", prompt="x", tenant="acme"), 5, "acme", 0.0, None)
            capacity[0] = 20
            acc.prefixes.add(chain([10, 20], "d"))  # d in, b and c out, while the flush is out
            await drop_connections(r, ACCOUNTING)
    await acc.flush()
    await named.aclose()
    assert await r.hget(NAMES.service, "acme") == b"15" and not await r.exists(NAMES.tenant_active("acme"))
    assert await advertised(r) == {"d0", "d1"}


async def flush_failing(acc: Accounting) -> None:
    with pytest.raises(RedisConnectionError):
        await acc.flush()


def unreachable() -> aioredis.Redis:
    """A client of a port nothing listens on, failing at once (no retries)."""
    return aioredis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))


@pytest.mark.anyio
async def test_the_loop_flushes_every_quarter_second_and_rides_out_a_failure(
        r: aioredis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamer.worker")
    acc = make(r)
    acc.redis = unreachable()
    async with anyio.create_task_group() as tg:
        tg.start_soon(acc.loop)
        acc.finished(Job("j1", "json", prompt="x"), 10, NO_TENANT, 0.0, None)
        with anyio.fail_after(10 * FLUSH_S + 5):
            while "accounting flush failed" not in caplog.text:
                await anyio.sleep(0.02)
        assert any(rec.getMessage().startswith("accounting flush failed (Error 111 connecting to 127.0.0.1:1")
                   and rec.getMessage().endswith("; retrying") for rec in caplog.records)
        await acc.redis.aclose()
        acc.redis = r
        with anyio.fail_after(10 * FLUSH_S + 5):
            while not await r.hexists(NAMES.service, NO_TENANT):
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
