"""What the worker leaves in Redis, checked against a real redis-server: each event is stored and
published exactly once, in seq order, even when it is written twice; every per-request key expires.

The EventWriter cases drive the writer directly (milliseconds each); one test runs real jobs through a
real worker and then inspects every key in the database, so a new per-request key without a TTL, or a
new path that forgets one, is caught without anyone having to remember to add a test for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis_worker_helpers import NAMES, check_complete, dead_letters, read_events, running_worker

from clients.redis_client import AsyncClient
from workers.event_writer import EventWriter, Write
from workers.protocol import decode_message, done_event, encode, token_event

TTL_MS = 60_000
# Published by the test after everything under test: Redis delivers a connection's messages in the
# order it executed the PUBLISHes, so once this arrives every earlier event has too (no sleeping).
END = b"end-of-test"


def tokens(rid: str, seqs: range) -> list[dict[str, Any]]:
    return [token_event(rid, s, 0, [100 + s], f"t{s}") for s in seqs]


async def flush(r: aioredis.Redis, *writes: Write) -> None:
    """One pipeline, as a worker sends one engine step: everything put before the writer runs goes out
    together. Calling it again with events Redis already holds is what a retried pipeline does."""
    writer = EventWriter(r, NAMES, TTL_MS)
    for w in writes:
        writer.put(w)
    writer.close()  # run() sends what is queued, then returns
    with anyio.fail_after(10):
        await writer.run()
    assert writer.round_trips == 1


async def subscribe(r: aioredis.Redis) -> PubSub:
    """A plain client on every tokens channel (a pattern, so a publish to any wrong channel shows)."""
    sub = r.pubsub()
    await sub.psubscribe(NAMES.tokens("*"))
    with anyio.fail_after(5):
        while (await sub.get_message(timeout=1)) is None:  # the psubscribe confirmation
            pass
    return sub


async def heard(r: aioredis.Redis, sub: PubSub, request_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every message published so far, per request id (channel), decoded, in arrival order."""
    for rid in request_ids:
        await r.publish(NAMES.tokens(rid), END)
    got: dict[str, list[dict[str, Any]]] = {}
    open_ids = set(request_ids)
    with anyio.fail_after(10):
        while open_ids:
            m = await sub.get_message(ignore_subscribe_messages=True, timeout=1)
            if m is None:
                continue
            rid = m["channel"].decode()[len(NAMES.tokens("")):]
            if m["data"] == END:
                open_ids.discard(rid)
            else:
                got.setdefault(rid, []).append(decode_message(m["data"]))
    await sub.aclose()
    return got


def assert_once_in_order(events: list[dict[str, Any]], n: int) -> None:
    assert [e["seq"] for e in events] == list(range(n)), [e["seq"] for e in events]


@pytest.fixture
async def r(redis_url: str) -> Any:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


# --- EventWriter against real Redis --------------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_events_written_twice_are_stored_and_published_once(r: aioredis.Redis, redis_url: str,
                                                                   encoding: str) -> None:
    """A retried pipeline re-sends what Redis may already hold: in the same flush (a batch put back and
    merged with new writes) and in a later one. Redis refuses the XADD of a seq it has; the event must
    then not be PUBLISHed either, or subscribers see it twice."""
    sub = await subscribe(r)
    rid = "twice"
    first = tokens(rid, range(3))
    await flush(r, Write(rid, encoding, first), Write(rid, encoding, first))
    await flush(r, Write(rid, encoding, first))
    await flush(r, Write(rid, encoding, [*first[1:], *tokens(rid, range(3, 5))]))
    live = (await heard(r, sub, [rid]))[rid]
    assert_once_in_order(live, 5)
    assert [encode(e, encoding) for e in live] == [encode(e, encoding) for e in tokens(rid, range(5))]
    assert read_events(redis_url, rid) == live  # the stream holds the same events, once each


@pytest.mark.anyio
async def test_two_workers_resuming_one_request_publish_each_seq_once(r: aioredis.Redis, redis_url: str) -> None:
    """Worker A is taken over after seq 1 is stored but goes on writing until its next heartbeat tells it;
    B, on its own connection, resumes at seq 2. Whoever stores a seq first owns it: the other's copy (here
    with different text) is neither stored nor published."""
    sub = await subscribe(r)
    rid = "contested"
    other = aioredis.Redis.from_url(redis_url)
    a = tokens(rid, range(6))
    b = [{**e, "text": "b"} for e in a]
    await flush(r, Write(rid, "json", a[0:4]))
    await flush(other, Write(rid, "json", b[2:6]))
    await flush(r, Write(rid, "json", a[4:6]))
    await other.aclose()
    live = (await heard(r, sub, [rid]))[rid]
    assert_once_in_order(live, 6)
    assert live == [*a[0:4], *b[4:6]]
    assert read_events(redis_url, rid) == live


@pytest.mark.anyio
async def test_event_stream_expires_and_each_write_renews_it(r: aioredis.Redis) -> None:
    rid = "ttl"
    key = NAMES.events(rid)
    await flush(r, Write(rid, "json", tokens(rid, range(2))))
    assert 0 < await r.pttl(key) <= TTL_MS
    # Stand in for time passing: an almost expired stream must get its full TTL back from the next
    # write, or a long generation loses its first events while still streaming.
    await r.pexpire(key, 1000)
    await flush(r, Write(rid, "json", tokens(rid, range(2, 3))))
    assert TTL_MS // 2 < await r.pttl(key) <= TTL_MS


@pytest.mark.anyio
async def test_ack_removes_the_job_and_gives_its_id_claim_the_events_ttl(r: aioredis.Redis) -> None:
    """The terminal write acks the job; the id claim must then live as long as the events (it rejects a
    reused id meanwhile) and no longer (or finished ids pile up in Redis forever)."""
    rid = "acked"
    await r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    entry = (await r.xadd(NAMES.requests, {"json": b"{}"})).decode()
    await r.xreadgroup(NAMES.group, "w", {NAMES.requests: ">"})
    # The claim was taken when the job was read, long ago: its TTL has almost run out.
    await r.set(NAMES.job(rid), entry, px=1000)
    await flush(r, Write(rid, "json", [*tokens(rid, range(2)), done_event(rid, 2, ["length"], {})],
                         ack_entry=entry))
    assert TTL_MS // 2 < await r.pttl(NAMES.job(rid)) <= TTL_MS
    assert 0 < await r.pttl(NAMES.events(rid)) <= TTL_MS
    assert await r.xlen(NAMES.requests) == 0
    assert (await r.xpending(NAMES.requests, NAMES.group))["pending"] == 0


# --- a real worker --------------------------------------------------------------------------------

GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.anyio
async def test_every_key_a_finished_job_leaves_expires(llama_ckpt: Path, redis_url: str,
                                                       r: aioredis.Redis) -> None:
    """Runs jobs down each way a job can end (done, n samples, rejected params, duplicate id, cancelled
    before it ran, deadline passed), then scans the whole database: apart from the two streams shared
    by all requests, every key must expire, within the configured TTL."""
    sub = await subscribe(r)
    # The test plays a client that cancels before submitting, and keeps its marker no longer than events.
    await r.set(NAMES.cancelled("early-cancel"), 1, px=TTL_MS)
    finished = {"plain": "done", "samples": "done", "bad-params": "error", "early-cancel": "done",
                "late": "error"}
    async with running_worker(llama_ckpt, redis_url, events_ttl_s=TTL_MS / 1000) as worker, \
            AsyncClient(redis_url) as client, AsyncClient(redis_url, encoding="msgpack") as mp_client:
        await client.submit("a plain job", id="plain", params=GREEDY)
        await mp_client.submit("two samples", id="samples", params={**GREEDY, "n": 2, "max_tokens": 6})
        await client.submit("x", id="bad-params", params={"max_tokens": -1})
        await client.submit("x", id="early-cancel", params=GREEDY)
        await client.submit("x", id="late", params=GREEDY, deadline=int(time.time() * 1000) - 1000)
        for rid, kind in finished.items():
            last = [e async for e in client.stream(rid, timeout=30)][-1]
            assert last["type"] == kind, (rid, last)
        await client.submit("the same id again", id="plain", params=GREEDY)
        with anyio.fail_after(30):  # every job acked, the duplicate included
            while await r.xlen(NAMES.requests) or (await r.xpending(NAMES.requests, NAMES.group))["pending"]:
                await anyio.sleep(0.02)
        assert worker.cfg.events_ttl_s == TTL_MS / 1000
    assert sorted(d["reason"].decode() for d in dead_letters(redis_url)) == ["duplicate_id", "invalid_params"]

    live = await heard(r, sub, list(finished))
    assert sorted(live) == sorted(finished)  # nothing on any other channel (the duplicate's included)
    for rid in finished:
        stored = read_events(redis_url, rid)
        check_complete(stored)
        assert live[rid] == stored, rid  # each event published once, in seq order, as stored

    shared = {NAMES.requests.encode(), NAMES.dead.encode()}
    keys = [key.decode() async for key in r.scan_iter(count=1000) if key not in shared]
    async with r.pipeline(transaction=True) as pipe:  # one MULTI: every PTTL against the same clock
        for key in keys:
            pipe.pttl(key)
        ttls = dict(zip(keys, await pipe.execute(), strict=True))
    unbounded = {k: t for k, t in ttls.items() if not 0 < t <= TTL_MS}
    assert not unbounded, f"keys without a TTL (-1) or with one over {TTL_MS} ms: {unbounded}"
    expected = ({NAMES.events(rid) for rid in finished} | {NAMES.job(rid) for rid in finished}
                | {NAMES.cancelled("early-cancel")})
    assert set(ttls) == expected  # the check above covered every kind of key (and nothing unknown)
    for rid in finished:
        # The claim, set when the job was read, is renewed by the ack: it must not expire before the
        # events it guards (a reused id would then be taken for a finished job and silently dropped).
        assert ttls[NAMES.job(rid)] >= ttls[NAMES.events(rid)], (rid, ttls)
