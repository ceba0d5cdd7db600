"""The router as a submitter runs it (clients/routing.py `Router`): what it reads from Redis about the
live workers (heartbeats, seats, loads, their own streams' length, advertised prefixes, a session's
owner) and the route it gives. The workers are played by the test, writing exactly the keys a worker
writes (docs/scheduling.md); the decision itself is tested as a pure function in test_routing.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from clients.names import DEFAULT_LANE_RANK, Names
from clients.routing import Route, Router, prefix_chain

NAMES = Names(lanes=(-1,))
SEATS = 2
JOB = {"id": "j:1", "prompt": "p" * 1024}  # 4 text segments of 64 tokens
CHAIN = prefix_chain(JOB)


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def worker(r: aioredis.Redis, name: str, seats: int = SEATS, holds: int = 0, shared_jobs: int = 0,
                 routed_jobs: int = 0) -> None:
    """A live worker as its heartbeats, stats, advert and own stream show it: `holds` leading
    segments of CHAIN in its cache, `shared_jobs` taken from the lanes, `routed_jobs` in its stream."""
    seconds, micros = await r.time()
    await r.zadd(NAMES.heartbeats, {name: seconds * 1000 + micros // 1000})
    await r.hset(NAMES.worker(name), mapping={"max_num_seqs": seats})
    await r.hset(NAMES.loads, name, shared_jobs)
    if holds:
        await r.sadd(NAMES.worker_prefixes(name), *(s.digest for s in CHAIN[:holds]))
    for i in range(routed_jobs):
        await r.xadd(NAMES.worker_requests(name), {"json": f"routed {i}"})


def lane(job: dict, outcome: str) -> Route:
    return Route(NAMES.requests, DEFAULT_LANE_RANK, outcome) if not job.get("priority") else \
        Route(f"{NAMES.requests}:prio-1", -1, outcome)


async def route(r: aioredis.Redis, job: dict = JOB, policy: str = "cache_load") -> Route:
    router = Router(r, NAMES, policy, refresh_s=0.0)
    got = await router.route(job)
    assert router.outcomes[got.outcome] == 1 and sum(router.outcomes.values()) == 1
    return got


@pytest.mark.anyio
async def test_one_live_worker_or_none_is_the_shared_lane(r: aioredis.Redis) -> None:
    assert await route(r) == lane(JOB, "shared")
    await worker(r, "w-a", holds=4)
    assert await route(r) == lane(JOB, "shared")  # even holding the whole prefix


@pytest.mark.anyio
async def test_the_worker_holding_the_prefix_gets_the_job(r: aioredis.Redis) -> None:
    await worker(r, "w-a", holds=1)  # 64 tokens: exactly the minimum match
    await worker(r, "w-b")
    assert await route(r) == Route(NAMES.worker_requests("w-a"), None, "hit", "w-a")
    await worker(r, "w-b", holds=3)
    assert await route(r) == Route(NAMES.worker_requests("w-b"), None, "hit", "w-b")


@pytest.mark.anyio
@pytest.mark.parametrize(("shared_jobs", "routed_jobs"), [(3, 0), (0, 3), (1, 2)])
async def test_a_full_holder_falls_back_to_the_lane_counting_both_kinds_of_jobs(
        r: aioredis.Redis, shared_jobs: int, routed_jobs: int) -> None:
    """Load = (jobs taken from the lanes + jobs in its own stream) / seats: 3 / 2 is full (1.5)."""
    await worker(r, "w-a", holds=4, shared_jobs=shared_jobs, routed_jobs=routed_jobs)
    await worker(r, "w-b")
    assert await route(r) == lane(JOB, "fallback")
    await r.hset(NAMES.worker("w-a"), "max_num_seqs", 3)  # a seat more: 3 / 3 has room again
    assert await route(r) == Route(NAMES.worker_requests("w-a"), None, "hit", "w-a")


@pytest.mark.anyio
async def test_a_sessions_worker_gets_its_next_call(r: aioredis.Redis) -> None:
    await worker(r, "w-a", holds=4)
    await worker(r, "w-b")
    await r.set(NAMES.session("chat-1"), "w-b")
    call = {**JOB, "session": "chat-1"}
    assert await route(r, call) == Route(NAMES.worker_requests("w-b"), None, "session", "w-b")
    assert await route(r, {**JOB, "session": "chat-2"}) == Route(NAMES.worker_requests("w-a"), None, "hit", "w-a")


@pytest.mark.anyio
async def test_a_miss_waits_in_its_lane_and_tenant_queue(r: aioredis.Redis) -> None:
    await worker(r, "w-a")
    await worker(r, "w-b")
    urgent = {**JOB, "priority": -1, "tenant": "acme"}
    assert await route(r, urgent) == Route(f"{NAMES.requests}:prio-1:t:acme", -1, "miss")
    assert await route(r, {"id": "j:2", "prompt": "short"}) == lane(JOB, "miss")
    assert await route(r, JOB, "shared") == lane(JOB, "shared")


@pytest.mark.anyio
async def test_sharded_streams_spread_by_id_and_never_route(r: aioredis.Redis) -> None:
    sharded = Names(shards=3)
    await worker(r, "w-a", holds=4)
    await worker(r, "w-b")
    got = await Router(r, sharded, refresh_s=0.0).route(JOB)
    assert got == Route(sharded.stream_for(JOB["id"]), None, "shared")


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="^routing policy must be one of cache_load, cache, least_loaded, random, "
                                         "shared$"):
        Router(None, NAMES, "nearest")
