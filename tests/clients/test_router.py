"""The router as a submitter runs it (clients/routing.py `Router`): what it reads from Redis about the
live workers (heartbeats, seats, loads, their own streams' length, advertised prefixes, a session's
owner) and the route it gives. The workers are played by the test, writing exactly the keys a worker
writes (docs/scheduling.md); the decision itself is tested as a pure function in test_routing.py."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio as aioredis

from clients.names import DEFAULT_LANE_RANK, Names
from clients.routing import Decision, Route, Router, WorkerView, choose, matched_tokens, prefix_chain

NAMES = Names(lanes=(-1,))
SEATS = 2
JOB = {"id": "j:1", "prompt": "p" * 1024}  # 4 text segments of 64 tokens
CHAIN = prefix_chain(JOB)


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def worker(r: aioredis.Redis, name: str, seats: int | None = SEATS, holds: int = 0,
                 shared_jobs: int | None = 0, routed_jobs: int = 0) -> None:
    """A live worker as its heartbeats, stats, advert and own stream show it: `holds` leading
    segments of CHAIN in its cache, `shared_jobs` taken from the lanes, `routed_jobs` in its stream
    (None: the field is missing, as from a worker of another version or one that has not flushed yet)."""
    seconds, micros = await r.time()
    await r.zadd(NAMES.heartbeats, {name: seconds * 1000 + micros // 1000})
    await r.hset(NAMES.worker(name), mapping={"tp": 1} if seats is None else {"max_num_seqs": seats})
    if shared_jobs is not None:
        await r.hset(NAMES.loads, name, shared_jobs)
    if holds:
        await r.sadd(NAMES.worker_prefixes(name), *(s.digest for s in CHAIN[:holds]))
    for i in range(routed_jobs):
        await r.xadd(NAMES.worker_requests(name), {"json": f"routed {i}"})


def lane(job: dict, outcome: str) -> Route:
    return Route(NAMES.requests, DEFAULT_LANE_RANK, outcome) if not job.get("priority") else \
        Route(f"{NAMES.requests}:prio-1", -1, outcome)


async def route(r: aioredis.Redis, job: dict = JOB, policy: str = "cache_load", **options: int) -> Route:
    router = Router(r, NAMES, policy, refresh_s=0.0, **options)
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
    sharded = Names(shards=2)
    await worker(r, "w-a", holds=4)
    await worker(r, "w-b")
    got = await Router(r, sharded, refresh_s=0.0).route(JOB)
    assert got == Route(sharded.stream_for(JOB["id"]), None, "shared")


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="^routing policy must be one of cache_load, cache, least_loaded, random, "
                                         "shared$"):
        Router(None, NAMES, "nearest")


@pytest.mark.anyio
@pytest.mark.parametrize(("seats", "shared_jobs", "routed_jobs", "room"), [
    (1, 1, 0, True), (1, 2, 0, False),  # one seat: 1 job is a load of 1.0 (room), 2 are 2.0 (full)
    (None, 2, 0, False),  # no seat count: one seat
    (1, None, 1, True), (1, 0, 1, True),  # no or a zero lane count: only its own stream counts
])
async def test_load_at_the_edges_of_what_the_workers_wrote(r: aioredis.Redis, seats: int | None,
                                                           shared_jobs: int | None, routed_jobs: int,
                                                           room: bool) -> None:
    await worker(r, "w-a", seats=seats, holds=4, shared_jobs=shared_jobs, routed_jobs=routed_jobs)
    await worker(r, "w-b")
    got = await route(r)
    assert got == (Route(NAMES.worker_requests("w-a"), None, "hit", "w-a") if room else lane(JOB, "fallback"))


@pytest.mark.anyio
async def test_damaged_keys_count_as_nothing_known_not_as_a_failure(r: aioredis.Redis) -> None:
    """Keys of the wrong type (written by hand, or by another program on a shared Redis): the router
    routes on what it could read."""
    await worker(r, "w-a", holds=4)
    await worker(r, "w-b", routed_jobs=1)
    await r.delete(NAMES.loads, NAMES.worker_prefixes("w-a"))
    await r.set(NAMES.loads, "not a hash")
    await r.set(NAMES.worker_prefixes("w-a"), "not a set")
    await r.set(NAMES.session(""), "w-b")  # a job without a session has no owner, whatever is stored
    assert await route(r, min_match_tokens=1) == lane(JOB, "miss")
    await r.set(NAMES.session("chat-1"), b"w-\xff")  # not UTF-8: no worker of that name
    assert await route(r, {**JOB, "session": "chat-1"}, min_match_tokens=1) == lane(JOB, "miss")


@pytest.mark.anyio
async def test_the_routers_own_settings_are_used(r: aioredis.Redis) -> None:
    await worker(r, "w-a", holds=1, shared_jobs=5)  # 64 tokens, and full
    await worker(r, "w-b")
    assert await route(r, min_match_tokens=128) == lane(JOB, "miss")
    assert await route(r, policy="cache") == Route(NAMES.worker_requests("w-a"), None, "hit", "w-a")  # load ignored


@pytest.mark.anyio
async def test_the_live_workers_are_read_again_after_half_a_second(r: aioredis.Redis) -> None:
    await worker(r, "w-a", holds=4)
    router = Router(r, NAMES)
    assert await router.route(JOB) == lane(JOB, "shared")  # alone
    await worker(r, "w-b")
    assert await router.route(JOB) == lane(JOB, "shared")  # not looked again yet
    await anyio.sleep(0.6)
    assert await router.route(JOB) == Route(NAMES.worker_requests("w-a"), None, "hit", "w-a")
    assert router.outcomes == {"session": 0, "hit": 1, "miss": 0, "fallback": 0, "shared": 2, "balanced": 0,
                               "adapter": 0}


VIEWS = [WorkerView(f"w{i}", i / 10) for i in range(10)]


def test_each_policy_names_its_outcome() -> None:
    assert choose("shared", VIEWS) == Decision(None, "shared") == choose("cache_load", [])
    for seed in range(5):  # the given generator draws, not the global one
        assert choose("random", VIEWS, rng=random.Random(seed)) == \
            Decision(random.Random(seed).choice(VIEWS).name, "balanced")
    tie = [WorkerView("b", 0.5), WorkerView("a", 0.5), WorkerView("c", 0.9)]
    assert choose("least_loaded", tie) == Decision("a", "balanced")


def test_cache_takes_the_longest_match_then_the_lighter_at_the_minimum() -> None:
    at_min = [WorkerView("a", 0.9, 64), WorkerView("b", 0.2, 64), WorkerView("c", 0.0, 10)]
    assert choose("cache", at_min) == Decision("b", "hit")
    assert choose("cache", [WorkerView("a", 0.0, 63)]) == Decision(None, "miss")


def test_cache_load_at_its_edges() -> None:
    assert choose("cache_load", [WorkerView("a", 0.0, 64), WorkerView("b", 0.0, 0)]) == Decision("a", "hit")
    # matched x (1 - load): 100 x 0.5 < 70 x 1.0
    assert choose("cache_load", [WorkerView("a", 0.5, 100), WorkerView("b", 0.0, 70)]) == Decision("b", "hit")
    # A session whose worker is gone routes as if it had none.
    assert choose("cache_load", [WorkerView("a", 0.0, 80)], session_owner="gone") == Decision("a", "hit")
    # The only holder, exactly at the minimum, is full: anyone may take it.
    assert choose("cache_load", [WorkerView("a", 1.5, 64), WorkerView("b", 0.0, 0)]) == Decision(None, "fallback")


def test_a_match_is_read_over_the_shorter_of_chain_and_reply() -> None:
    assert matched_tokens(CHAIN[:2], [1, 1, 1]) == CHAIN[1].tokens
    assert matched_tokens(CHAIN, [1, 1]) == CHAIN[1].tokens


@pytest.mark.anyio
async def test_a_refresh_while_a_route_waits_on_redis_does_not_break_it(r: aioredis.Redis) -> None:
    """Concurrent requests share one router: one's refresh may drop a worker that just died while
    another waits for its pipeline (seen live: HTTP 500 KeyError under 600 streams with a worker
    SIGKILLed). The waiting one finishes on the seats it read."""
    import asyncio

    await worker(r, "w1", holds=4)
    await worker(r, "w2")
    router = Router(r, NAMES, "cache_load", refresh_s=3600.0)
    await router._refresh()

    async def worker_dies() -> None:
        router._capacity = {"w2": SEATS}  # what a refresh reads once w1's heartbeat is gone

    views, _ = (await asyncio.gather(router._views(CHAIN, None), worker_dies()))[0]
    assert [v.name for v in views] == ["w1", "w2"]
