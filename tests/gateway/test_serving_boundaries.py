"""Boundaries of the serving layer that no end-to-end test reaches exactly: priority lane cutoffs on
both sides, the tenant charge correction when the job was charged at take time to another service
field than its tenant's (a job routed to a worker's own stream), ids holding `:` in the client's and
a taking-over worker's resume. Real redis-server, no model (the test writes the worker's events)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from test_gateway import done, emit, tokens

from clients.names import DEFAULT_LANE_RANK, Names
from clients.protocol import decode_job, encode_job
from clients.redis_client import AsyncClient
from clients.resume import resume_state
from workers.worker.accounting import Accounting
from workers.worker.streams import CHARGE_TOKENS, NO_TENANT, StreamSet, Taken

LANES = Names(lanes=(-10, -1))


@pytest.mark.parametrize(("priority", "lane"), [
    (-11, -10), (-10, -10),  # a cutoff's own priority waits in its lane, the more urgent one
    (-9, -1), (-2, -1), (-1, -1),
    (0, None), (5, None),  # the default lane: after every cutoff
])
def test_lane_for_at_each_side_of_each_cutoff(priority: int, lane: int | None) -> None:
    stream, rank = LANES.lane_for(priority)
    if lane is None:
        assert (stream, rank) == (LANES.requests, DEFAULT_LANE_RANK)
    else:
        assert (stream, rank) == (f"{LANES.requests}:prio{lane}", lane)


@pytest.mark.anyio
async def test_a_job_at_a_cutoff_is_pushed_to_that_lane(redis_url: str) -> None:
    async with AsyncClient(redis_url, names=LANES, routing="shared") as client:
        rid = await client.submit("x", priority=-1)
        assert client._placements[rid].stream == f"{LANES.requests}:prio-1"
        assert await client.redis.xlen(f"{LANES.requests}:prio-1") == 1


CONSUMER = "w-1"
NAMES = Names()
TOKENS = 100  # what the job really cost


async def take_one(r: aioredis.Redis) -> Taken:
    streams = StreamSet(r, NAMES, CONSUMER)
    taken = await streams.take(1)
    assert len(taken) == 1
    return taken[0]


async def finish(r: aioredis.Redis, taken: Taken) -> None:
    """What the worker does when the job's last event is written: correct the charge, flush."""
    accounting = Accounting(r, NAMES, CONSUMER, ttl_ms=60_000)
    accounting.finished(decode_job(taken.fields), TOKENS, taken.tenant, taken.charged, None)
    await accounting.flush()


async def service(r: aioredis.Redis, field: str) -> float:
    return float(await r.hget(NAMES.service, field) or 0)


@pytest.mark.anyio
@pytest.mark.parametrize("share", [1, 4])
async def test_a_routed_tenant_job_is_charged_what_it_cost(redis_url: str, share: int) -> None:
    """Routed to a worker's own stream, a tenant's job is charged at take time to that stream's field
    (no tenant), not the tenant's: its end must charge the tenant the whole cost, not cost - charge."""
    r = aioredis.Redis.from_url(redis_url)
    await r.hset(NAMES.tenants, "acme", share)
    ((field, payload),) = encode_job({"id": "routed", "prompt": "x", "tenant": "acme"}).items()
    await r.xadd(NAMES.worker_requests(CONSUMER), {field: payload})
    taken = await take_one(r)
    assert (taken.stream, taken.tenant, taken.charged) == (NAMES.worker_requests(CONSUMER), NO_TENANT, CHARGE_TOKENS)
    assert await service(r, "acme") == 0  # the take charged another field
    await finish(r, taken)
    assert await service(r, "acme") == TOKENS / share
    await r.aclose()


@pytest.mark.anyio
async def test_a_tenant_job_from_its_own_queue_is_charged_the_difference(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with AsyncClient(redis_url, routing="shared") as client:
        await client.submit("x", id="queued", tenant="acme")
    taken = await take_one(r)
    assert (taken.tenant, taken.charged) == ("acme", CHARGE_TOKENS)
    at_take = await service(r, "acme")
    await finish(r, taken)
    assert await service(r, "acme") == at_take - CHARGE_TOKENS + TOKENS
    await r.aclose()


COLON_ID = "team:a:1"  # ids may hold `:` (the separator of the gateway's SSE ids `<request id>:<seq>`)


@pytest.mark.anyio
async def test_an_id_with_colons_resumes_in_the_client_and_in_a_taking_over_worker(redis_url: str) -> None:
    """The two resume paths outside the gateway (its /ws and SSE ones: test_gateway.py and
    test_openai_api.py): a client's stream from a seq, and the fold a worker taking over the job reads."""
    r = aioredis.Redis.from_url(redis_url)
    await emit(r, COLON_ID, tokens(COLON_ID, range(0, 4)))
    state = resume_state(await r.xrange(NAMES.events(COLON_ID)))
    assert (state.next_seq, state.token_ids, state.finished) == (4, {0: [0, 1, 2, 3]}, False)
    await emit(r, COLON_ID, [done(COLON_ID, 4)])
    async with AsyncClient(redis_url) as client:
        rest = [e async for e in client.stream(COLON_ID, after_seq=1, timeout=5, wait_for_worker=True)]
    assert [(e["seq"], e["type"]) for e in rest] == [(2, "token"), (3, "token"), (4, "done")]
    assert resume_state(await r.xrange(NAMES.events(COLON_ID))).finished
    await r.aclose()
