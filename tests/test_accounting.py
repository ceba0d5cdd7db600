"""What a worker's accounting writes to Redis in one flush (workers/worker/accounting.py): its stream's
registration, its load, the sessions it now serves, the tenants' slots it frees, the charges, its
advertised prefixes (added, dropped, expiring, written whole again), and what leaving removes. Real
redis-server; the engine is stood in for by its two numbers (KV capacity, jobs held). The charge
correction at its boundaries is in test_serving_boundaries.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from clients.names import Names
from clients.protocol import Job
from clients.routing import answer_chain, prefix_chain
from workers.worker import accounting
from workers.worker.accounting import SESSION_TTL_MS, Accounting
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
async def test_a_flush_registers_the_worker_its_load_and_its_sessions(r: aioredis.Redis) -> None:
    acc = make(r, held=3)
    acc.started(Job("j1", "json", messages=CHAT, session="chat-1"))
    acc.started(Job("j2", "json", prompt="x"))  # no session: no key
    seconds, _ = await r.time()
    await acc.flush()
    score = await r.zscore(NAMES.worker_streams, ME)
    assert score is not None and abs(score / 1000 - seconds) < 60  # when it last flushed, in ms
    assert await r.hget(NAMES.loads, ME) == b"3"
    assert await r.get(NAMES.session("chat-1")) == ME.encode()
    assert SESSION_TTL_MS - 5_000 < await r.pttl(NAMES.session("chat-1")) <= SESSION_TTL_MS
    assert await r.keys(f"{NAMES.prefix}:session:*") == [NAMES.session("chat-1").encode()]


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
async def test_leaving_removes_the_advert_and_the_load(r: aioredis.Redis) -> None:
    acc = make(r, held=2)
    acc.started(Job("j1", "json", messages=CHAT))
    await acc.flush()
    await r.hset(NAMES.loads, "w-2", 1)
    await acc.leave()
    assert not await r.exists(NAMES.worker_prefixes(ME))
    assert await r.hgetall(NAMES.loads) == {b"w-2": b"1"}
