"""Routing and priority that the workers apply to jobs pushed with a plain XADD (workers/worker/lanes.py,
workers/worker/affinity.py), each script on its own against a real redis-server: a raw job whose
priority belongs in a lane is moved there before the take reads (and only one no worker has read);
a session's job taken by another worker is forwarded to the worker holding the session when that one
is live, not draining and has room, exactly once, else recorded as the taker's session at once; a
moved entry keeps the request id its submitter claimed; routers skip a draining worker too; the worker's
--priority-lanes. The workers themselves: test_any_submitter.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import msgpack
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from clients.errors import ProtocolError
from clients.heartbeats import STALE_MS
from clients.names import BATCH_PRIORITY, Names
from clients.protocol import decode_job, encode_job
from clients.routing import Router
from workers.worker import intake
from workers.worker.affinity import SESSION_TTL_MS, Affinity
from workers.worker.lanes import MOVED_FROM, moved_from
from workers.worker.state import Delivery
from workers.worker.streams import StreamSet

NAMES = Names(lanes=(-10, -1))
ME, HOLDER = "w-me", "w-holder"


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def register(r: aioredis.Redis, names: Names = NAMES) -> None:
    """The lanes in the registry, as a worker started with --priority-lanes (or a submitter) leaves them."""
    await r.zadd(names.streams, {names.lane(c): c for c in names.lanes})


def raw(rid: str, **job: object) -> dict[str, str]:
    return {"json": json.dumps({"v": 1, "id": rid, "prompt": "x", **job})}


async def ids_in(r: aioredis.Redis, stream: str) -> list[str]:
    """The ids of the jobs in `stream`, in order ("?" for a payload that does not decode)."""
    ids = []
    for _, fields in await r.xrange(stream):
        try:
            ids.append(decode_job(moved_from(fields)[0]).id)
        except ProtocolError:
            ids.append("?")
    return ids


@pytest.mark.anyio
async def test_raw_jobs_move_to_their_lane_and_are_taken_before_the_backlog(r: aioredis.Redis) -> None:
    await register(r)
    for i in range(5):
        await r.xadd(NAMES.requests, raw(f"backlog-{i}"))
    first = await r.xadd(NAMES.requests, raw("urgent", priority=-5))
    await r.xadd(NAMES.requests, {"msgpack": msgpack.packb({"v": 1, "id": "most", "prompt": "x", "priority": -10})})
    await r.xadd(NAMES.requests, raw("mild", priority=3))
    await r.xadd(NAMES.requests, {"json": '{"v": 1, "id": "broken", "priority": -5'})  # not JSON: left
    streams = StreamSet(r, Names(), ME)  # the worker needs no lanes of its own: the registry has them
    taken = await streams.take(2)
    assert [decode_job(moved_from(t.fields)[0]).id for t in taken] == ["most", "urgent"]
    assert [t.stream for t in taken] == [NAMES.lane(-10), NAMES.lane(-1)]
    assert moved_from(taken[1].fields)[1] == first.decode()  # the entry it was pushed as
    assert await ids_in(r, NAMES.requests) == [*(f"backlog-{i}" for i in range(5)), "mild", "?"]
    last = (await r.xrange(NAMES.requests))[-1][0]
    assert await r.get(NAMES.lane_cursor) == last  # each entry is looked at once


@pytest.mark.anyio
async def test_an_entry_a_worker_has_read_is_not_moved(r: aioredis.Redis) -> None:
    await register(r)
    await r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    await r.xadd(NAMES.requests, raw("read-already", priority=-5))
    await r.xreadgroup(NAMES.group, "w-other", {NAMES.requests: ">"}, count=1)
    await r.delete(NAMES.lane_cursor)  # a cursor lost (Redis restarted): the group's position is the floor
    await r.xadd(NAMES.requests, raw("new", priority=-5))
    taken = await StreamSet(r, Names(), ME).take(5)
    assert [decode_job(moved_from(t.fields)[0]).id for t in taken] == ["new"]
    assert await ids_in(r, NAMES.requests) == ["read-already"]  # still pending with w-other
    assert (await r.xpending(NAMES.requests, NAMES.group))["pending"] == 1


@pytest.mark.anyio
async def test_no_lanes_nothing_moves_and_a_lane_known_by_its_tenants_is_registered(r: aioredis.Redis) -> None:
    await r.xadd(NAMES.requests, raw("stays", priority=-5))
    taken = await StreamSet(r, Names(), ME).take(1)
    assert [t.stream for t in taken] == [NAMES.requests] and not await r.exists(NAMES.lane_cursor)
    # A gateway with tenants pushes to `{lane}:t:{tenant}` only: the lane itself is registered by the reader.
    await r.zadd(NAMES.streams, {NAMES.tenant_stream(NAMES.lane(-1), "acme"): -1})
    await r.xadd(NAMES.requests, raw("moves", priority=-1))
    taken = await StreamSet(r, Names(), ME).take(1)
    assert [t.stream for t in taken] == [NAMES.lane(-1)]
    assert await r.zscore(NAMES.streams, NAMES.lane(-1)) == -1


@pytest.mark.anyio
async def test_a_moved_entry_takes_over_the_id_its_submitter_claimed(r: aioredis.Redis) -> None:
    claim = r.register_script(intake._CLAIM)
    keys = [NAMES.job("j1"), NAMES.fence("j1")]
    await r.set(NAMES.job("j1"), "1-0")  # what SUBMIT_SCRIPT wrote for the entry it pushed
    owner, epoch, *_ = await claim(keys=keys, args=["5-0", 60_000, "1-0"])
    assert (owner, epoch) == (b"5-0", 1) and await r.get(NAMES.job("j1")) == b"5-0"
    owner, epoch, *_ = await claim(keys=keys, args=["6-0", 60_000, "2-0"])  # another entry: a duplicate
    assert (owner, epoch) == (b"5-0", 0)
    owner, epoch, *_ = await claim(keys=keys, args=["5-0", 60_000, "1-0"])  # the same entry again (takeover)
    assert (owner, epoch) == (b"5-0", 2)


async def holder(r: aioredis.Redis, *, seats: int = 2, shared: int = 0, beat_ago_ms: int = 0,
                 draining: bool = False, names: Names = NAMES) -> None:
    """A worker `HOLDER` as its heartbeat and accounting show it, holding session s1."""
    seconds, _ = await r.time()
    await r.zadd(names.heartbeats, {HOLDER: int(seconds) * 1000 - beat_ago_ms})
    await r.hset(names.worker(HOLDER), mapping={"max_num_seqs": seats, "draining": int(draining)})
    await r.hset(names.loads, HOLDER, shared)
    await r.set(names.session("s1"), HOLDER)


async def taken(r: aioredis.Redis, stream: str = NAMES.requests, names: Names = NAMES, **job: object) -> Delivery:
    """A session job pushed raw to `stream` and read by this worker, decoded as intake does."""
    with contextlib.suppress(ResponseError):  # BUSYGROUP: a take created it
        await r.xgroup_create(stream, names.group, id="0", mkstream=True)
    await r.xadd(stream, encode_job({"id": "j1", "prompt": "x", "session": "s1", **job}))
    [(_, [(entry_id, fields)])] = await r.xreadgroup(names.group, ME, {stream: ">"})
    return Delivery(entry_id.decode(), fields, 1, stream=stream, job=decode_job(fields))


@pytest.mark.anyio
async def test_a_sessions_job_is_forwarded_to_its_worker_once(r: aioredis.Redis) -> None:
    await holder(r)
    d = await taken(r)
    forwarded = []
    affinity = Affinity(r, NAMES, ME, on_forward=forwarded.append)
    assert await affinity.place([d]) == [] and forwarded == [d]
    [(_, fields)] = await r.xrange(NAMES.worker_requests(HOLDER))
    assert moved_from(fields) == (d.fields, d.entry_id)
    assert await r.xlen(NAMES.requests) == 0 and (await r.xpending(NAMES.requests, NAMES.group))["pending"] == 0
    # The same call again (its reply was lost and it is retried): the entry is gone, nothing is added.
    assert await affinity.place([d]) == [] and forwarded == [d]
    assert await r.xlen(NAMES.worker_requests(HOLDER)) == 1
    assert await r.get(NAMES.session("s1")) == HOLDER.encode()


@pytest.mark.parametrize("state", [{"beat_ago_ms": STALE_MS + 1000}, {"draining": True}, {"shared": 3},
                                   {"seats": 0}])
@pytest.mark.anyio
async def test_a_dead_draining_or_full_sessions_worker_leaves_the_job_here(r: aioredis.Redis, state: dict) -> None:
    await holder(r, **state)
    d = await taken(r)
    assert await Affinity(r, NAMES, ME).place([d]) == [d]
    assert await r.get(NAMES.session("s1")) == ME.encode()  # the session's KV will be here from now on
    assert SESSION_TTL_MS - 5_000 < await r.pttl(NAMES.session("s1")) <= SESSION_TTL_MS
    assert not await r.exists(NAMES.worker_requests(HOLDER))


@pytest.mark.parametrize("where", ["own stream", "batch", "retried"])
@pytest.mark.anyio
async def test_jobs_placed_on_purpose_or_seen_before_are_not_forwarded(r: aioredis.Redis, where: str) -> None:
    await holder(r)
    if where == "own stream":
        d = await taken(r, NAMES.worker_requests(ME))
    elif where == "batch":
        d = await taken(r, priority=BATCH_PRIORITY)
    else:
        d = await taken(r)
        d.deliveries = 2  # reclaimed: it may have run already
    assert await Affinity(r, NAMES, ME).place([d]) == [d]
    assert await r.get(NAMES.session("s1")) == ME.encode()


@pytest.mark.anyio
async def test_the_taker_is_the_sessions_worker_at_once(r: aioredis.Redis) -> None:
    d = await taken(r)
    other = Delivery("9-0", {}, 1, stream=NAMES.requests, job=decode_job(encode_job({"id": "j2", "prompt": "y"})))
    assert await Affinity(r, NAMES, ME).place([d, other]) == [d, other]
    assert await r.get(NAMES.session("s1")) == ME.encode()
    assert await r.keys(f"{NAMES.prefix}:session:*") == [NAMES.session("s1").encode()]


def test_moved_from_strips_the_field() -> None:
    assert moved_from({b"json": b"{}", MOVED_FROM.encode(): b"1-0"}) == ({b"json": b"{}"}, "1-0")
    assert moved_from({b"json": b"{}"}) == ({b"json": b"{}"}, "")


@pytest.mark.anyio
async def test_on_a_cluster_moves_and_forwards_stay_in_one_slot(one_node_cluster_url: str) -> None:
    """Hash-tagged names: the take script's move and the forward touch one slot (a real node refuses
    CROSSSLOT), and a fresh node's NOSCRIPT is answered by loading the script."""
    names = Names(cluster=True, lanes=(-1,))
    rc = aioredis.RedisCluster.from_url(one_node_cluster_url)
    try:
        await register(rc, names)
        await rc.xadd(names.requests, raw("urgent", priority=-5))
        assert [t.stream for t in await StreamSet(rc, Names(cluster=True), ME).take(1)] == [names.lane(-1)]
        await holder(rc, names=names)
        d = await taken(rc, names.lane(-1), names)
        assert await Affinity(rc, names, ME).place([d]) == []
        assert await rc.xlen(names.worker_requests(HOLDER)) == 1
        assert await rc.xrange(names.lane(-1), d.entry_id, d.entry_id) == []
    finally:
        await rc.aclose()


@pytest.mark.anyio
async def test_routers_send_nothing_to_a_draining_worker(r: aioredis.Redis) -> None:
    """The holder of s1 is draining (SIGTERM: it reads no more jobs): a router leaves it out, as the
    workers' forward does, and the session's job waits in the shared lane for the others."""
    await holder(r, draining=True)
    seconds, _ = await r.time()
    for name in ("w-x", "w-y"):
        await r.zadd(NAMES.heartbeats, {name: int(seconds) * 1000})
        await r.hset(NAMES.worker(name), mapping={"max_num_seqs": 2, "draining": 0})
    route = await Router(r, NAMES, refresh_s=0.0).route({"id": "j1", "prompt": "x", "session": "s1"})
    assert (route.worker, route.outcome, route.stream) == (None, "miss", NAMES.requests)
    await r.hset(NAMES.worker(HOLDER), "draining", 0)  # back to work: its sessions are routed to it again
    route = await Router(r, NAMES, refresh_s=0.0).route({"id": "j2", "prompt": "x", "session": "s1"})
    assert (route.worker, route.outcome) == (HOLDER, "session")


def test_worker_lanes_come_from_the_flag_and_refuse_sharded_streams() -> None:
    from workers.cli.main import command_parser
    from workers.errors import UserError
    from workers.worker.command import worker_config

    parser = command_parser("worker")
    args = parser.parse_args(["--model", "m", "--priority-lanes=-1,-10"])
    args.cluster = False
    assert worker_config(args).names.lanes == (-10, -1)
    args = parser.parse_args(["--model", "m", "--priority-lanes=-1", "--request-shards", "2"])
    args.cluster = False
    with pytest.raises(UserError, match="--priority-lanes or --request-shards"):
        worker_config(args)
