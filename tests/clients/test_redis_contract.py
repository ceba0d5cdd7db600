"""What the worker leaves in Redis, checked against a real redis-server: each event is stored and
published exactly once, in seq order, even when it is written twice; every per-request key expires.

The EventWriter cases drive the writer directly (milliseconds each), also through faults caused on the
server: a round trip held, its connection dropped, cancelled in flight, writes refused. One test runs
real jobs through a real worker and then inspects every key in the database, so a new per-request key
without a TTL, or a new path that forgets one, is caught without anyone having to remember to add a
test for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.crc import key_slot
from redis_faults import drop_connections, writes_held
from redis_worker_helpers import NAMES, check_complete, dead_letters, read_events, running_worker

from clients.events import done_event, token_event
from clients.protocol import Names, decode_event, decode_message, encode
from clients.redis_client import AsyncClient
from workers.worker.event_writer import EventWriter, Write

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


async def heard(r: aioredis.Redis, sub: PubSub, request_ids: list[str],
                names: Names = NAMES) -> dict[str, list[dict[str, Any]]]:
    """Every message published so far, per request id (channel), decoded, in arrival order. With
    cluster names the channels are shard channels."""
    for rid in request_ids:
        await (r.spublish if names.cluster else r.publish)(names.tokens(rid), END)
    got: dict[str, list[dict[str, Any]]] = {}
    open_ids = set(request_ids)
    of_channel = {names.tokens(rid).encode(): rid for rid in request_ids}
    with anyio.fail_after(10):
        while open_ids:
            m = await sub.get_message(ignore_subscribe_messages=True, timeout=1)
            if m is None:
                continue
            rid = of_channel.get(m["channel"]) or m["channel"].decode()[len(names.tokens("")):]
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
async def test_writes_of_a_fenced_off_owner_are_refused_and_reported(r: aioredis.Redis, redis_url: str) -> None:
    """A takes the job (epoch 1), is presumed dead and B claims it (epoch 2). Everything A writes from
    then on, events and its ack, is refused whole and reported to A (so it drops the job), while B's
    writes and ack land: the stream is A's events before the takeover, then B's, nothing mixed."""
    rid = "fenced"
    await r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    entry = (await r.xadd(NAMES.requests, {"json": b"{}"})).decode()
    await r.xreadgroup(NAMES.group, "a", {NAMES.requests: ">"})
    await r.hset(NAMES.fence(rid), "epoch", 1)
    fenced: list[tuple[str, int]] = []
    writer_a = EventWriter(r, NAMES, TTL_MS, on_fenced=lambda *f: fenced.append(f))
    a = tokens(rid, range(4))
    b = [{**e, "text": "b"} for e in tokens(rid, range(2, 4))]
    a_written: list[str] = []
    writer_a.put(Write(rid, "json", a[:2], epoch=1, on_written=recorder(a_written, "a:0-1")))
    writer_a.close()
    await writer_a.run()
    assert await r.hincrby(NAMES.fence(rid), "epoch", 1) == 2  # B's claim
    writer_a = EventWriter(r, NAMES, TTL_MS, on_fenced=lambda *f: fenced.append(f))
    writer_a.put(Write(rid, "json", [*a[2:], done_event(rid, 4, ["length"], {})], ack_entry=entry, epoch=1,
                       on_written=recorder(a_written, "a:2-4")))
    # Another job of A's in the same flush, claimed with another epoch (it was reclaimed once): it lands,
    # and only the fenced write's own epoch is reported.
    writer_a.put(Write("bystander", "json", tokens("bystander", range(1)), epoch=3,
                       on_written=recorder(a_written, "bystander")))
    writer_a.close()
    await writer_a.run()
    assert fenced == [(rid, 1)] and a_written == ["a:0-1", "bystander"]
    assert (await r.xpending(NAMES.requests, NAMES.group))["pending"] == 1  # A's ack was refused too
    await flush(r, Write(rid, "json", [*b, done_event(rid, 4, ["length"], {})], ack_entry=entry, epoch=2))
    assert read_events(redis_url, rid)[:4] == [*a[:2], *b]
    assert read_events(redis_url, "bystander") == tokens("bystander", range(1))  # no fence: not refused
    assert await r.xlen(NAMES.requests) == 0
    assert 0 < await r.pttl(NAMES.fence(rid)) <= TTL_MS


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


@pytest.mark.anyio
async def test_one_flush_acks_each_job_in_the_stream_that_holds_it(r: aioredis.Redis, redis_url: str) -> None:
    """A worker finishes jobs read from the shared stream, from its own (routed to it) and from a dead
    worker's own stream (adopted) in one flush: each is acked and removed where it is, one ack script per
    stream, and the events of all three go in one script call."""
    streams = {"shared": NAMES.requests, "own": NAMES.worker_requests("w"), "adopted": NAMES.worker_requests("dead")}
    entries: dict[str, str] = {}
    for rid, stream in streams.items():
        await r.xgroup_create(stream, NAMES.group, id="0", mkstream=True)
        entries[rid] = (await r.xadd(stream, {"json": b"{}"})).decode()
        await r.xreadgroup(NAMES.group, "w", {stream: ">"})
    await r.config_resetstat()
    await flush(r, *(Write(rid, "json", [*tokens(rid, range(2)), done_event(rid, 2, ["length"], {})],
                           ack_entry=entries[rid], ack_stream="" if rid == "shared" else stream)
                     for rid, stream in streams.items()))
    for rid, stream in streams.items():
        assert await r.xlen(stream) == 0 and (await r.xpending(stream, NAMES.group))["pending"] == 0, rid
        assert await r.xlen(NAMES.events(rid)) == 3
    stats = await r.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1 + len(streams)


# --- one long-lived EventWriter, as the worker runs it: waiting, acks, faults -----------------------
# Faults are caused on the real server: CLIENT PAUSE WRITE holds the writer's round trip at Redis (so
# the test can act while it is in flight), CLIENT KILL drops its connection, CONFIG SET makes Redis
# refuse writes. Reads and CLIENT/CONFIG commands go on during a WRITE pause.

WRITER = "event-writer-under-test"  # CLIENT SETNAME of the writer's connections, to find them


@pytest.fixture
async def writer(redis_url: str) -> AsyncIterator[EventWriter]:
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, client_name=WRITER)
    # Connected (and named) before any pause: Redis 7.0 holds a new connection's handshake too.
    await client.ping()
    yield EventWriter(client, NAMES, TTL_MS)
    await client.aclose()


async def in_flight(writer: EventWriter) -> None:
    """Until the writer's round trip is at Redis, held there by `writes_held`: the writer has taken what
    was put, and no round trip has come back."""
    await anyio.wait_all_tasks_blocked()
    assert writer.round_trips == 0


def writer_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [rec.getMessage() for rec in caplog.records
            if rec.name == "streamer.worker" and rec.levelno == logging.WARNING]


def recorder(calls: list[str], name: str) -> Callable[[], None]:
    return lambda: calls.append(name)


@pytest.mark.anyio
async def test_wait_idle_waits_for_every_write_put_before_it_returns(r: aioredis.Redis,
                                                                    writer: EventWriter) -> None:
    """`wait_idle` (the worker's last wait before it stops) returns only once Redis holds everything put so
    far, including what is put while someone already waits; everything put while the writer was busy
    goes out in one round trip; and once idle, a new put makes it wait again."""
    seen: dict[str, int] = {}

    async def wait_then_look() -> None:
        await writer.wait_idle()
        for rid in ("a", "b"):
            seen[rid] = await r.xlen(NAMES.events(rid))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as services:
            async with anyio.create_task_group() as waiters:
                writer.put(Write("a", "json", tokens("a", range(2))))
                waiters.start_soon(wait_then_look)
                await anyio.wait_all_tasks_blocked()
                assert not seen  # the writer is not even running: the waiter must still be waiting
                writer.put(Write("b", "json", tokens("b", range(3))))  # put while it waits
                services.start_soon(writer.run)
            assert seen == {"a": 2, "b": 3}
            assert writer.round_trips == 1  # both writes in one round trip
            writer.put(Write("a", "json", tokens("a", range(2, 4))))
            await writer.wait_idle()
            assert await r.xlen(NAMES.events("a")) == 4
            assert writer.round_trips == 2
            writer.close()


@pytest.mark.anyio
async def test_on_written_runs_once_per_write_after_redis_holds_its_events_and_ack(
        r: aioredis.Redis, redis_url: str, writer: EventWriter) -> None:
    """The worker stops keeping a job alive in `on_written`: it must run once per write, and only once
    Redis holds that write's events and, for the final write, has acked and removed the job."""
    await r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    entry = (await r.xadd(NAMES.requests, {"json": b"{}"})).decode()
    await r.xreadgroup(NAMES.group, "w", {NAMES.requests: ">"})
    sync = redis.Redis.from_url(redis_url)  # the callbacks are plain functions: look with a blocking client
    seen: list[tuple[str, int, int, int]] = []

    def look(rid: str) -> Callable[[], None]:
        return lambda: seen.append((rid, sync.xlen(NAMES.events(rid)), sync.xlen(NAMES.requests),
                                    sync.xpending(NAMES.requests, NAMES.group)["pending"]))

    final = [*tokens("job", range(1, 2)), done_event("job", 2, ["length"], {})]
    writer.put(Write("job", "json", tokens("job", range(1)), on_written=look("job")))
    writer.put(Write("other", "json", tokens("other", range(3)), on_written=look("other")))
    writer.put(Write("job", "json", final, ack_entry=entry, on_written=look("job")))
    writer.close()
    with anyio.fail_after(10):
        await writer.run()
    sync.close()
    assert sorted(seen) == [("job", 3, 0, 0), ("job", 3, 0, 0), ("other", 3, 0, 0)]


@pytest.mark.anyio
async def test_a_dropped_connection_is_retried_until_everything_is_in_redis_once(
        r: aioredis.Redis, redis_url: str, writer: EventWriter, caplog: pytest.LogCaptureFixture) -> None:
    """A round trip lost with its connection (a Redis restart) is retried, together with what was put
    while it was in flight, until Redis takes it: each event stored and published once, each
    `on_written` run once, after the retry. `close` during the outage still lets all of it out before
    `run` returns. The outage is logged, naming the writer and the error."""
    sub = await subscribe(r)
    a, b = tokens("a", range(3)), tokens("b", range(1))
    written: list[str] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            async with writes_held(r):
                writer.put(Write("a", "json", a[:2], on_written=recorder(written, "a:0-1")))
                await in_flight(writer)
                writer.put(Write("a", "json", a[2:], on_written=recorder(written, "a:2")))
                writer.put(Write("b", "json", b, on_written=recorder(written, "b:0")))
                await drop_connections(r, WRITER)
                writer.close()
                assert written == []
            # run returns once it has sent everything
    assert sorted(written) == ["a:0-1", "a:2", "b:0"]
    live = await heard(r, sub, ["a", "b"])
    assert live == {"a": a, "b": b}
    assert read_events(redis_url, "a") == a and read_events(redis_url, "b") == b
    assert any(m.startswith("event writer: Redis unavailable (ConnectionError") for m in writer_warnings(caplog)), \
        writer_warnings(caplog)


@pytest.mark.anyio
async def test_a_round_trip_cancelled_in_flight_loses_no_write(r: aioredis.Redis, redis_url: str,
                                                               writer: EventWriter) -> None:
    """Cancelling `run` while a round trip is in flight (the worker's task group cancelled) keeps both
    that round trip's writes and those put meanwhile: the next `run` sends them all."""
    events = tokens("c", range(3))
    written: list[str] = []
    with anyio.fail_after(10):
        async with writes_held(r), anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            writer.put(Write("c", "json", events[:2], on_written=recorder(written, "c:0-1")))
            await in_flight(writer)
            writer.put(Write("c", "json", events[2:], on_written=recorder(written, "c:2")))
            tg.cancel_scope.cancel()
        assert written == []
        writer.close()
        await writer.run()
    assert sorted(written) == ["c:0-1", "c:2"]
    assert read_events(redis_url, "c") == events


@pytest.mark.anyio
async def test_a_command_redis_refuses_is_logged_and_the_rest_of_the_flush_lands(
        r: aioredis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A command Redis refuses (here the ack, the requests key holding a string: WRONGTYPE) would be
    refused again on a retry: it is logged, not retried, and the flush's other commands still take
    effect: the events are stored and published, the job's id claim gets the events' TTL."""
    sub = await subscribe(r)
    rid = "refused-ack"
    await r.set(NAMES.requests, "not a stream")
    await r.set(NAMES.job(rid), "1-1", px=1000)
    events = [*tokens(rid, range(2)), done_event(rid, 2, ["length"], {})]
    await flush(r, Write(rid, "json", events, ack_entry="1-1"))  # one round trip, then run returns
    assert (await heard(r, sub, [rid]))[rid] == events
    assert read_events(redis_url, rid) == events
    assert TTL_MS // 2 < await r.pttl(NAMES.job(rid)) <= TTL_MS
    assert any(m.startswith("event writer: Redis refused a write: WRONGTYPE") for m in writer_warnings(caplog)), \
        writer_warnings(caplog)


@pytest.mark.anyio
async def test_writes_redis_refuses_are_not_retried_and_the_writer_carries_on(
        r: aioredis.Redis, redis_url: str, writer: EventWriter, caplog: pytest.LogCaptureFixture) -> None:
    """Redis can refuse every write for a while (NOREPLICAS: a primary told to need a replica has none).
    A refusal is an answer, not an outage: the writer logs it and goes on with the next writes instead
    of stalling every job behind one it cannot deliver (the unacked job is taken over later)."""
    await r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    entry = (await r.xadd(NAMES.requests, {"json": b"{}"})).decode()
    later = tokens("later", range(2))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            await r.config_set("min-replicas-to-write", 1)
            try:
                writer.put(Write("refused", "json", [done_event("refused", 0, ["length"], {})],
                                 ack_entry=entry))
                await writer.wait_idle()
            finally:
                await r.config_set("min-replicas-to-write", 0)
            assert writer.round_trips == 1  # answered once, not retried
            writer.put(Write("later", "json", later))
            await writer.wait_idle()
            writer.close()
    assert read_events(redis_url, "later") == later
    assert await r.xlen(NAMES.events("refused")) == 0
    assert any(m.startswith("event writer: Redis refused a write: NOREPLICAS") for m in writer_warnings(caplog)), \
        writer_warnings(caplog)


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
    # The rejected params were answered in their own stream: only the duplicate is a dead letter.
    assert [d["reason"].decode() for d in dead_letters(redis_url)] == ["duplicate_id"]

    live = await heard(r, sub, list(finished))
    assert sorted(live) == sorted(finished)  # nothing on any other channel (the duplicate's included)
    for rid in finished:
        stored = read_events(redis_url, rid)
        check_complete(stored)
        assert live[rid] == stored, rid  # each event published once, in seq order, as stored

    # The queue's own keys (docs/scheduling.md), not any job's: the stream registry, the tenants'
    # service clock, the workers that own a stream and the worker's own stream.
    shared = {k.encode() for k in (NAMES.requests, NAMES.dead, NAMES.streams, NAMES.service, NAMES.worker_streams,
                                   NAMES.loads, NAMES.worker_requests(worker.cfg.consumer))}
    keys = [key.decode() async for key in r.scan_iter(count=1000) if key not in shared]
    async with r.pipeline(transaction=True) as pipe:  # one MULTI: every PTTL against the same clock
        for key in keys:
            pipe.pttl(key)
        ttls = dict(zip(keys, await pipe.execute(), strict=True))
    unbounded = {k: t for k, t in ttls.items() if not 0 < t <= TTL_MS}
    assert not unbounded, f"keys without a TTL (-1) or with one over {TTL_MS} ms: {unbounded}"
    expected = ({NAMES.events(rid) for rid in finished} | {NAMES.job(rid) for rid in finished}
                | {NAMES.fence(rid) for rid in finished} | {NAMES.cancelled("early-cancel")})
    assert set(ttls) == expected  # the check above covered every kind of key (and nothing unknown)
    for rid in finished:
        # The claim, set when the job was read, is renewed by the ack: it must not expire before the
        # events it guards (a reused id would then be taken for a finished job and silently dropped).
        assert ttls[NAMES.job(rid)] >= ttls[NAMES.events(rid)], (rid, ttls)


@pytest.mark.anyio
async def test_the_slowest_round_trip_since_the_last_look_is_reported_once(r: aioredis.Redis,
                                                                          writer: EventWriter) -> None:
    """A slow-step trace names the slowest event write of its step: `take_slowest_round_trip` is the
    longest round trip since the previous call (not the last one), then starts again from zero; every
    round trip's time also goes to `on_round_trip` (the write-time metric)."""
    times: list[float] = []
    writer.on_round_trip = times.append
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            async with writes_held(r):
                writer.put(Write("slow", "json", tokens("slow", range(1))))
                await in_flight(writer)
                await anyio.sleep(0.3)  # the round trip waits at Redis this long
            await writer.wait_idle()
            writer.put(Write("fast", "json", tokens("fast", range(1))))
            await writer.wait_idle()
            writer.close()
    assert len(times) == writer.round_trips == 2 and times[0] >= 0.3 > times[1]
    assert writer.take_slowest_round_trip() == times[0]
    assert writer.take_slowest_round_trip() == 0.0  # nothing since the last look


# --- on a Redis Cluster (one node holding every slot: see conftest.py) ------------------------------
# There the events of one slot go in one script call, published on shard channels (SPUBLISH), a fresh
# node answers NOSCRIPT (a cluster pipeline sends plain EVALSHA), and the acks follow in a second round
# trip, since the requests stream and a request's keys are in different slots.

CLUSTER = Names(cluster=True)


@pytest.fixture
async def rc(one_node_cluster_url: str) -> AsyncIterator[aioredis.RedisCluster]:
    client = aioredis.RedisCluster.from_url(one_node_cluster_url)
    yield client
    await client.aclose()


async def cluster_flush(rc: aioredis.RedisCluster, *writes: Write, on_fenced: Callable[[str, int], None] | None = None,
                        round_trips: int) -> None:
    """Everything put goes out as one flush of a worker on a cluster, in `round_trips` round trips."""
    writer = EventWriter(rc, CLUSTER, TTL_MS, **({"on_fenced": on_fenced} if on_fenced else {}))
    for w in writes:
        writer.put(w)
    writer.close()
    with anyio.fail_after(10):
        await writer.run()
    assert writer.round_trips == round_trips


async def shard_subscribe(url: str, request_ids: list[str]) -> tuple[aioredis.Redis, PubSub]:
    """A plain client of the node, on each request's shard channel (SSUBSCRIBE hears only SPUBLISH)."""
    node = aioredis.Redis.from_url(url)
    sub = node.pubsub()
    with anyio.fail_after(5):
        for rid in request_ids:  # one at a time: one SSUBSCRIBE names channels of one slot only
            await sub.ssubscribe(CLUSTER.tokens(rid))
            while (await sub.get_message(timeout=1)) is None:  # its confirmation
                pass
    return node, sub


def same_slot_ids(prefix: str, count: int) -> list[str]:
    """`count` request ids whose keys share one slot (a flush sends them in one script call)."""
    by_slot: dict[int, list[str]] = {}
    for i in range(100_000):
        rid = f"{prefix}-{i}"
        ids = by_slot.setdefault(key_slot(CLUSTER.events(rid).encode()), [])
        ids.append(rid)
        if len(ids) == count:
            return ids
    raise AssertionError("no slot found")


async def evalsha_calls(url: str) -> int:
    node = aioredis.Redis.from_url(url)
    stats = await node.info("commandstats")
    await node.aclose()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.anyio
async def test_a_flush_on_a_cluster_is_one_script_per_slot_published_on_shard_channels(
        rc: aioredis.RedisCluster, one_node_cluster_url: str) -> None:
    """Three requests, two of them in one slot: two script calls in one round trip (a script whose keys
    span slots is refused with CROSSSLOT), each event stored once and heard once on its shard channel."""
    together, alone = same_slot_ids("pair", 2), "alone"
    ids = [*together, alone]
    assert key_slot(CLUSTER.events(alone).encode()) != key_slot(CLUSTER.events(together[0]).encode())
    await cluster_flush(rc, Write("warm-up", "json", tokens("warm-up", range(1))), round_trips=2)  # NOSCRIPT, again
    node, sub = await shard_subscribe(one_node_cluster_url, ids)
    before = await evalsha_calls(one_node_cluster_url)
    await cluster_flush(rc, *(Write(rid, "json", tokens(rid, range(3))) for rid in ids), round_trips=1)
    assert await evalsha_calls(one_node_cluster_url) - before == 2
    live = await heard(node, sub, ids, names=CLUSTER)
    await node.aclose()
    assert live == {rid: tokens(rid, range(3)) for rid in ids}
    for rid in ids:
        assert await rc.xlen(CLUSTER.events(rid)) == 3 and 0 < await rc.pttl(CLUSTER.events(rid)) <= TTL_MS


@pytest.mark.anyio
async def test_a_fresh_cluster_node_gets_the_scripts_and_the_flush_lands_once(
        rc: aioredis.RedisCluster, one_node_cluster_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A node that holds no script (fresh, or restarted without them) answers NOSCRIPT: the writer loads
    them and sends the whole flush again, and nothing is stored, published or acked twice."""
    rid = "fresh"
    await rc.xgroup_create(CLUSTER.requests, CLUSTER.group, id="0", mkstream=True)
    entry = (await rc.xadd(CLUSTER.requests, {"json": b"{}"})).decode()
    await rc.xreadgroup(CLUSTER.group, "w", {CLUSTER.requests: ">"})
    node, sub = await shard_subscribe(one_node_cluster_url, [rid])
    events = [*tokens(rid, range(2)), done_event(rid, 2, ["length"], {})]
    # The refused round trip, then the events and the acks apart.
    await cluster_flush(rc, Write(rid, "json", events, ack_entry=entry), round_trips=3)
    assert (await heard(node, sub, [rid], names=CLUSTER))[rid] == events
    await node.aclose()
    assert [decode_event(f) for _, f in await rc.xrange(CLUSTER.events(rid))] == events
    assert await rc.xlen(CLUSTER.requests) == 0
    assert any(m.startswith("event writer: Redis unavailable (NoScriptError") for m in writer_warnings(caplog)), \
        writer_warnings(caplog)


@pytest.mark.anyio
async def test_a_write_put_while_a_fresh_node_refuses_the_scripts_is_kept(
        rc: aioredis.RedisCluster, one_node_cluster_url: str) -> None:
    """What is put while the refused (NOSCRIPT) round trip is out goes with the retry too."""
    node = aioredis.Redis.from_url(one_node_cluster_url)
    writer = EventWriter(rc, CLUSTER, TTL_MS)
    await rc.initialize()  # the slot map read before writes are held
    events = {rid: tokens(rid, range(2)) for rid in ("first", "meanwhile", "last")}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            async with writes_held(node):
                writer.put(Write("first", "json", events["first"]))
                await in_flight(writer)
                writer.put(Write("meanwhile", "json", events["meanwhile"]))
                writer.put(Write("last", "json", events["last"]))
            writer.close()
    await node.aclose()
    for rid, sent in events.items():
        assert [decode_event(f) for _, f in await rc.xrange(CLUSTER.events(rid))] == sent, rid


@pytest.mark.anyio
async def test_acks_on_a_cluster_follow_apart_and_skip_a_job_taken_over(rc: aioredis.RedisCluster) -> None:
    """Finished jobs are acked and removed from the stream that holds them (the shared one, or a worker's
    own for a routed job) and their id claim and fence get the events' TTL, in a round trip after the
    events; a job another worker claimed since is neither acked nor renewed, and is reported."""
    own = CLUSTER.worker_requests("w")
    entries: dict[str, str] = {}
    for stream in (CLUSTER.requests, own):
        await rc.xgroup_create(stream, CLUSTER.group, id="0", mkstream=True)
    for rid, stream in (("shared", CLUSTER.requests), ("routed", own), ("taken", CLUSTER.requests)):
        entries[rid] = (await rc.xadd(stream, {"json": b"{}"})).decode()
        await rc.xreadgroup(CLUSTER.group, "w", {stream: ">"})
        await rc.set(CLUSTER.job(rid), entries[rid], px=1000)  # claimed long ago: almost expired
        await rc.hset(CLUSTER.fence(rid), "epoch", 2 if rid == "taken" else 1)
    fenced: list[tuple[str, int]] = []
    await cluster_flush(rc, *(Write(rid, "json", [done_event(rid, 0, ["length"], {})], ack_entry=entries[rid],
                                    ack_stream=own if rid == "routed" else "", epoch=1)
                              for rid in entries),
                        on_fenced=lambda *f: fenced.append(f), round_trips=3)  # NOSCRIPT, events, acks
    assert fenced == [("taken", 1)]
    assert [e for e, _ in await rc.xrange(CLUSTER.requests)] == [entries["taken"].encode()]
    assert (await rc.xpending(CLUSTER.requests, CLUSTER.group))["pending"] == 1
    assert await rc.xlen(own) == 0 and (await rc.xpending(own, CLUSTER.group))["pending"] == 0
    for rid in ("shared", "routed"):
        assert TTL_MS // 2 < await rc.pttl(CLUSTER.job(rid)) <= TTL_MS
        assert TTL_MS // 2 < await rc.pttl(CLUSTER.fence(rid)) <= TTL_MS
    assert await rc.pttl(CLUSTER.job("taken")) <= 1000 and await rc.pttl(CLUSTER.fence("taken")) == -1
