"""The order a worker takes jobs in (workers/worker/streams.py, docs/scheduling.md), on its own against a
real redis-server: its own stream, then the lanes from the most urgent, inside a lane the tenant whose
service per unit of share is least; a tenant back from idle starts at most a burst behind; a registry
that changed and groups Redis lost are found again. The submitters' side is the real AsyncClient."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio as aioredis

from clients.names import Names
from clients.protocol import decode_job, encode_job
from clients.redis_client import AsyncClient
from workers.worker.streams import BURST_TOKENS, CHARGE_TOKENS, NO_TENANT, REFRESH_S, StreamSet

NAMES = Names(lanes=(-1,))
ME = "w-1"


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(redis_url, names=NAMES, routing="shared") as c:
        yield c


async def take_ids(streams: StreamSet, count: int) -> list[str]:
    return [decode_job(t.fields).id for t in await streams.take(count)]


@pytest.mark.anyio
async def test_own_stream_then_the_urgent_lane_then_the_default(r: aioredis.Redis, client: AsyncClient) -> None:
    await client.submit("x", id="default")
    await client.submit("x", id="urgent", priority=-1)
    # A routed entry with a field more than a job has: every field is handed on (intake judges them).
    routed = await r.xadd(NAMES.worker_requests(ME), {**encode_job({"id": "routed", "prompt": "x"}), "extra": "1",
                                                      "more": "2"})
    streams = StreamSet(r, NAMES, ME)
    taken = await streams.take(5)
    assert taken[0].entry_id == routed and set(taken[0].fields) == {b"json", b"extra", b"more"}
    assert [t.entry_id for t in taken[1:]] == [(await r.xrange(s))[0][0] for s in (
        f"{NAMES.requests}:prio-1", NAMES.requests)]
    assert [decode_job(t.fields).id for t in taken[1:]] == ["urgent", "default"]
    assert {(t.tenant, t.charged) for t in taken} == {(NO_TENANT, CHARGE_TOKENS)}
    assert [t.stream for t in taken] == [NAMES.worker_requests(ME), f"{NAMES.requests}:prio-1", NAMES.requests]
    assert await streams.take(5) == []
    pending = await r.xpending(NAMES.requests, NAMES.group)
    assert pending["pending"] == 1 and pending["consumers"] == [{"name": ME.encode(), "pending": 1}]


@pytest.mark.anyio
async def test_before_it_reads_the_registry_a_worker_reads_its_own_stream_only(r: aioredis.Redis) -> None:
    """A worker stopping before its first take leaves the groups of `names_read` (redis_worker._leave):
    with no registry read yet, that is its own stream alone."""
    assert StreamSet(r, NAMES, ME).names_read == [NAMES.worker_requests(ME)]


@pytest.mark.anyio
async def test_tenants_are_served_by_their_shares(r: aioredis.Redis, client: AsyncClient) -> None:
    await r.hset(NAMES.tenants, mapping={"small": 1, "big": 3})
    for i in range(12):
        await client.submit("x", id=f"small-{i}", tenant="small")
        await client.submit("x", id=f"big-{i}", tenant="big")
    streams = StreamSet(r, NAMES, ME)
    order = [rid for _ in range(8) for rid in await take_ids(streams, 1)]
    assert Counter(rid.split("-")[0] for rid in order) == {"big": 6, "small": 2}
    assert [int(rid.split("-")[1]) for rid in order if rid.startswith("big")] == list(range(6))  # in order
    service = {k.decode(): float(v) for k, v in (await r.hgetall(NAMES.service)).items()}
    assert service["small"] == 2 * CHARGE_TOKENS and service["big"] == pytest.approx(6 * CHARGE_TOKENS / 3)
    # Several at once take the same turns as one at a time.
    many = StreamSet(r, NAMES, "w-2")
    assert Counter(rid.split("-")[0] for rid in await take_ids(many, 8)) == {"big": 6, "small": 2}


@pytest.mark.anyio
async def test_a_tenant_back_from_idle_starts_a_burst_behind(r: aioredis.Redis, client: AsyncClient) -> None:
    await r.hset(NAMES.service, mapping={"~clock": 100_000, "busy": 100_000})
    await client.submit("x", id="late", tenant="idle")
    streams = StreamSet(r, NAMES, ME)
    assert await take_ids(streams, 1) == ["late"]
    assert float(await r.hget(NAMES.service, "idle")) == 100_000 - BURST_TOKENS + CHARGE_TOKENS


@pytest.mark.anyio
async def test_a_changed_registry_and_lost_groups_are_found_again(r: aioredis.Redis, client: AsyncClient) -> None:
    streams = StreamSet(r, NAMES, ME)
    assert await streams.take(1) == []  # registry read, groups made
    await client.submit("x", id="new-tenant", tenant="acme")  # a queue the registry did not hold then
    assert await take_ids(streams, 1) == ["new-tenant"]
    await client.submit("x", id="after-loss", tenant="acme")
    queue = NAMES.tenant_stream(NAMES.requests, "acme")
    await r.xgroup_destroy(queue, NAMES.group)  # Redis lost it (a restart without persistence)
    assert await streams.take(1) == []  # the group is made again, from id 0: every entry is new to it
    assert await take_ids(streams, 2) == ["new-tenant", "after-loss"]
    await calls(r)
    await streams.refresh(force=True)
    assert (await calls(r))["xgroup|create"] == 0  # the groups Redis did not lose are not made again


@pytest.mark.anyio
async def test_waiting_takes_one_entry_uncharged_with_its_tenant(r: aioredis.Redis, client: AsyncClient) -> None:
    streams = StreamSet(r, NAMES, ME)
    await streams.refresh(force=True)
    assert await streams.wait_any(50) == []  # nothing yet: back after the block
    async with anyio.create_task_group() as tg:  # an entry pushed while it waits ends the wait
        tg.start_soon(client.submit, "x")
        assert len(await streams.wait_any(5000)) == 1
    await client.submit("x", id="first", tenant="acme")
    await client.submit("x", id="second", tenant="acme")
    streams.forget_groups()  # Redis lost its groups: the next look reads the registry and makes them
    await streams.refresh()
    (taken,) = await streams.wait_any(1000)
    assert (decode_job(taken.fields).id, taken.tenant, taken.charged) == ("first", "acme", 0.0)
    assert taken.entry_id == (await r.xrange(taken.stream))[0][0]
    assert taken.stream == NAMES.tenant_stream(NAMES.requests, "acme")
    assert await r.hget(NAMES.service, "acme") is None  # charged only at its end


async def calls(r: aioredis.Redis) -> Counter[str]:
    """Commands the server ran since the last look, by name (INFO commandstats, then reset)."""
    stats = await r.info("commandstats")
    await r.config_resetstat()
    return Counter({name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()})


@pytest.mark.anyio
async def test_a_warm_take_is_one_round_trip(r: aioredis.Redis, client: AsyncClient) -> None:
    """A worker takes many times a second: once it has read the registry and made its groups, a take is
    one script call. The registry is read again at most every REFRESH_S (or when the script says it
    changed), and a stream's group is made once, not at every read of the registry."""
    await client.submit("x", id="a", tenant="acme")
    streams = StreamSet(r, NAMES, ME)
    assert await take_ids(streams, 1) == ["a"]  # the registry read, a group made per stream
    await calls(r)
    started = time.monotonic()
    for _ in range(5):
        assert await streams.take(1) == []
    elapsed = time.monotonic() - started
    warm = await calls(r)
    # On a slow machine the loop may pass a refresh or more (each one read of the registry).
    assert warm["zrange"] <= elapsed // REFRESH_S and warm["evalsha"] == 5, (warm, elapsed)
    assert warm["xgroup|create"] == 0
    await streams.refresh(force=True)
    assert (await calls(r))["xgroup|create"] == 0  # groups made before are not made again
