"""streamer on a real 3-master Redis Cluster started on loopback ports: every key of a request in one
slot (hash tags), requests spread over the masters, event writes batched per slot, sharded pub/sub,
and a worker killed mid-generation resumed on another with nothing lost or sent twice."""

import os
import signal
import uuid

import pytest
import redis
from redis.cluster import RedisCluster
from redis_worker_helpers import (
    check_complete,
    long_context_checkpoint,
    offline_tokens,
    running_worker,
    tokens_of,
    wait_for,
    worker_process,
)

from clients.protocol import Names, decode_event, seq_of_stream_id
from clients.redis_client import AsyncClient
from streamer import SamplingParams
from workers.redis_server import LocalCluster

NAMES = Names(cluster=True)
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(masters=3) as c:
        yield c


@pytest.fixture
def cluster_url(cluster):
    for node in cluster.nodes:
        redis.Redis(port=node.port).flushall()
    return cluster.url


def events_of(url, request_id):
    client = RedisCluster.from_url(url)
    try:
        entries = client.xrange(NAMES.events(request_id))
    finally:
        client.close()
    assert [seq_of_stream_id(i) for i, _ in entries] == list(range(len(entries)))  # once each, in order
    return [decode_event(fields) for _, fields in entries]


def node_of(cluster, key):
    """The port of the master holding `key`."""
    for node in cluster.nodes:
        try:
            if redis.Redis(port=node.port).exists(key):
                return node.port
        except redis.exceptions.MovedError:  # the slot is another master's
            continue
    return None


@pytest.mark.anyio
async def test_requests_are_served_across_the_cluster(llama_ckpt, cluster, cluster_url):
    prompts = [f"cluster job {i}: spread the keys" for i in range(8)]
    async with running_worker(llama_ckpt, cluster_url, names=NAMES), \
            AsyncClient(cluster_url, cluster=True) as client, \
            AsyncClient(cluster_url, cluster=True, encoding="msgpack") as mp_client:
        ids = [await (mp_client if i % 2 else client).submit(p, params=GREEDY) for i, p in enumerate(prompts)]
        live = [await client.generate("streamed through the client", params=GREEDY, timeout=60) for _ in range(2)]
        await wait_for(lambda: all(events_of(cluster_url, i) and events_of(cluster_url, i)[-1]["type"] == "done"
                                   for i in ids), timeout=60)
    expected = offline_tokens(llama_ckpt, prompts, SamplingParams(**GREEDY))
    for request_id, tokens in zip(ids, expected, strict=True):
        events = events_of(cluster_url, request_id)
        assert check_complete(events)["type"] == "done" and tokens_of(events) == tokens
        # Every key of a request on one master: the scripts that touch them together can run.
        homes = {node_of(cluster, key) for key in (NAMES.events(request_id), NAMES.job(request_id),
                                                   NAMES.fence(request_id))}
        assert len(homes) == 1 and None not in homes
    assert all(len(g.token_ids[0]) == 8 for g in live)
    assert len({node_of(cluster, NAMES.events(i)) for i in ids}) >= 2  # spread, not all on one master
    assert node_of(cluster, NAMES.requests) is not None


def _ids_per_shard(names: Names, per_shard: int) -> list[str]:
    """Fresh random ids, `per_shard` of them on each request stream (9 random ids alone miss a shard
    in about 8% of runs)."""
    counts = dict.fromkeys(names.request_streams, 0)
    ids: list[str] = []
    while len(ids) < per_shard * len(counts):
        rid = uuid.uuid4().hex
        if counts[names.stream_for(rid)] < per_shard:
            counts[names.stream_for(rid)] += 1
            ids.append(rid)
    return ids


@pytest.mark.anyio
@pytest.mark.parametrize("on_cluster", [True, False])
async def test_requests_sharded_over_streams(llama_ckpt, cluster_url, redis_url, on_cluster):
    """--request-shards 3: jobs spread over three streams (on a cluster, three slots), every one
    served, acked on its own stream."""
    names = Names(cluster=on_cluster, shards=3)
    url = cluster_url if on_cluster else redis_url
    prompts = [f"sharded job {i}" for i in range(9)]
    async with running_worker(llama_ckpt, url, names=names), AsyncClient(url, names=names) as client:
        ids = [await client.submit(p, params=GREEDY, id=rid) for p, rid in zip(prompts, _ids_per_shard(names, 3))]
        results = []
        for request_id in ids:
            results.append([e async for e in client.stream(request_id, timeout=60)])
    expected = offline_tokens(llama_ckpt, prompts, SamplingParams(**GREEDY))
    assert [tokens_of(events) for events in results] == expected
    probe = (RedisCluster if on_cluster else redis.Redis).from_url(url)
    used = {names.stream_for(i) for i in ids}
    assert used == set(names.request_streams)  # 9 ids over 3 shards: each got some
    for stream in names.request_streams:
        assert probe.xlen(stream) == 0 and probe.xpending(stream, names.group)["pending"] == 0
    probe.close()


@pytest.mark.anyio
async def test_a_worker_killed_on_the_cluster_is_resumed_by_another(cluster, cluster_url, tmp_path):
    """Two workers, jobs over two request streams (two slots); one is SIGKILLed mid-generation."""
    ckpt = long_context_checkpoint(tmp_path / "ckpt")
    # Long enough to be mid-generation when the test looks: at 300 tokens the jobs of a fresh-clone
    # run (the test process starved for CPU by the two workers) had finished before the kill.
    params = {"max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"long cluster job {i}" for i in range(4)]
    names = Names(cluster=True, shards=2)
    procs = {name: worker_process(ckpt, cluster_url, "--consumer", name, "--claim-idle", "1.0",
                                  "--request-shards", "2", log_path=tmp_path / f"{name}.log")
             for name in ("w-a", "w-b")}
    try:
        probe = RedisCluster.from_url(cluster_url)
        await wait_for(lambda: probe.zcard(NAMES.heartbeats) == 2, timeout=60, interval=0.1)
        async with AsyncClient(cluster_url, names=names) as client:
            ids = [await client.submit(p, params=params) for p in prompts]
        await wait_for(lambda: all(len(events_of(cluster_url, i)) >= 5 for i in ids), timeout=60, interval=0.02)
        owners = {p["consumer"].decode() for stream in names.request_streams
                  for p in probe.xpending_range(stream, names.group, "-", "+", 10)}
        assert owners, "every job finished before the kill"
        victim = sorted(owners)[0]
        os.kill(procs[victim].pid, signal.SIGKILL)
        assert any(events_of(cluster_url, i)[-1]["type"] == "token" for i in ids), "finished before the kill"
        await wait_for(lambda: all(events_of(cluster_url, i)[-1]["type"] == "done" for i in ids), timeout=120)
        probe.close()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    expected = offline_tokens(ckpt, prompts, SamplingParams(**params))
    for request_id, tokens in zip(ids, expected, strict=True):
        events = events_of(cluster_url, request_id)
        assert check_complete(events)["type"] == "done" and tokens_of(events) == tokens


@pytest.mark.anyio
async def test_dead_letters_on_the_cluster_are_listed_and_requeued(llama_ckpt, cluster_url):
    """`streamer dead` finds the cluster by itself; a requeued job goes to its stream and is served."""
    import json

    from test_dead_letters import cli

    probe = RedisCluster.from_url(cluster_url)
    payload = json.dumps({"v": 1, "id": "again", "prompt": "served after all", "params": GREEDY})
    dead_id = probe.xadd(NAMES.dead, {"reason": "too_many_deliveries", "message": "m", "entry": "1-1",
                                      "worker": "w", "time_ms": 1, "id": "again", "payload_json": payload})
    listed = await cli("dead", "list", url=cluster_url)
    assert listed.returncode == 0 and "too_many_deliveries" in listed.stdout, listed.stderr
    requeued = await cli("dead", "requeue", dead_id.decode(), url=cluster_url)
    assert requeued.returncode == 0, requeued.stderr
    assert probe.xlen(NAMES.dead) == 0 and probe.xlen(NAMES.requests) == 1
    async with running_worker(llama_ckpt, cluster_url, names=NAMES):
        await wait_for(lambda: [e["type"] for e in events_of(cluster_url, "again")][-1:] == ["done"], timeout=60)
    assert tokens_of(events_of(cluster_url, "again")) == offline_tokens(llama_ckpt, ["served after all"],
                                                                        SamplingParams(**GREEDY))[0]
    probe.close()


@pytest.mark.anyio
async def test_gateway_on_the_cluster_relays_over_sharded_pubsub(llama_ckpt, cluster_url):
    """Through the gateway: jobs pushed to sharded streams, tokens relayed over shard channels
    (the idle poll is turned far down, so the events can only come by SSUBSCRIBE), a resume and a
    cancel of requests whose keys sit on different masters."""
    from test_gateway import collect, config, send
    from websockets.asyncio.client import connect

    from workers.gateway.server import running_gateway

    names = Names(cluster=True, shards=2)
    prompts = [f"gateway on the cluster {i}" for i in range(4)]
    candidates = [f"g{i}" for i in range(40)]
    ids = [i for i in candidates if names.stream_for(i) == names.request_streams[0]][:2] + \
          [i for i in candidates if names.stream_for(i) == names.request_streams[1]][:2]
    gateway = config(cluster_url, cluster=True, request_shards=2, idle_poll_s=120.0)
    async with running_worker(llama_ckpt, cluster_url, names=names), running_gateway(gateway) as gw:
        async with connect(gw.ws_url) as ws:
            for request_id, prompt in zip(ids, prompts, strict=True):
                await send(ws, {"type": "generate", "id": request_id, "prompt": prompt, "params": GREEDY})
            got = await collect(ws, set(ids), timeout=60)
        async with connect(gw.ws_url) as ws:  # a later socket replays a finished request from seq 3
            await send(ws, {"type": "resume", "id": ids[0], "after_seq": 2})
            replay = (await collect(ws, {ids[0]}, timeout=30))[ids[0]]
            long = {"max_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
            await send(ws, {"type": "generate", "id": "cancel-me", "prompt": "long", "params": long})
            await wait_for(lambda: len(events_of(cluster_url, "cancel-me")) >= 2, timeout=30)
            await send(ws, {"type": "cancel", "id": "cancel-me"})
            cancelled = (await collect(ws, {"cancel-me"}, timeout=30))["cancel-me"]
        fills = gw.metrics.values["stream_fills_total"]
    expected = offline_tokens(llama_ckpt, prompts, SamplingParams(**GREEDY))
    assert [tokens_of(got[request_id]) for request_id in ids] == expected  # over both request streams
    assert replay == got[ids[0]][3:]
    assert fills <= 2  # the resume's reads only: the live events came by pub/sub
    assert cancelled[-1]["type"] == "done" and cancelled[-1]["finish_reason"] == "abort"
    assert len(tokens_of(cancelled)) < 2000
