"""Bursts (issue 13): a gateway whose Redis pool is full queues commands instead of failing them.

Before, redis-py's default pool (100 connections) raised as soon as a burst needed more, and the
clients got `redis_unavailable` (101 of 200, 161 of 300, 401 of 500 in one burst). Now every process
uses workers.redis_options.async_client: a bounded pool where a command waits for a free connection.
The full-size benchmark (5000 streams) is bench/burst.py."""

from __future__ import annotations

import asyncio
import json
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_worker_helpers import running_worker
from test_gateway import config, without_workers
from websockets.asyncio.client import connect

from clients.backoff import TRANSIENT
from workers.gateway.server import running_gateway
from workers.redis_options import async_client, pool_url

STREAMS = 1000
PARAMS = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


def opened(client: aioredis.Redis) -> int:
    pool = client.connection_pool
    return len(pool._available_connections) + len(pool._in_use_connections)


@pytest.mark.anyio
async def test_a_full_pool_queues_and_a_too_long_wait_fails_as_unavailable(redis_url: str) -> None:
    client = async_client(redis_url, max_connections=3, timeout_s=10)
    try:
        # 300 commands at once, 50 of them holding their connection for 20 ms: all served by 3 connections.
        replies = await asyncio.gather(*(client.blpop(["nothing"], timeout=0.02) if i % 6 == 0 else client.ping()
                                         for i in range(300)))
        assert replies.count(True) == 250 and replies.count(None) == 50
        assert opened(client) <= 3
    finally:
        await client.aclose()
    # redis-py's default pool fails the same burst at once.
    plain = aioredis.Redis.from_url(redis_url, max_connections=3)
    try:
        results = await asyncio.gather(*(plain.blpop(["nothing"], timeout=0.02) for _ in range(10)),
                                       return_exceptions=True)
        assert any(isinstance(r, RedisConnectionError) for r in results)
    finally:
        await plain.aclose()
    # A wait past the pool timeout fails like an unreachable Redis (callers retry it or say so).
    client = async_client(redis_url, max_connections=1, timeout_s=0.2)
    try:
        hold = asyncio.ensure_future(client.blpop(["nothing"], timeout=1))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(TRANSIENT):
            await client.ping()
        assert 0.15 < time.monotonic() - start < 0.9
        assert await hold is None
    finally:
        await client.aclose()
    # The URL's own bound wins over the flag's (pool_url only adds what the URL does not say).
    url = pool_url(redis_url + "?max_connections=2", 50, 1.5)
    client = async_client(url)
    assert (client.connection_pool.max_connections, client.connection_pool.timeout) == (2, 1.5)
    await client.aclose()


def _room_for_sockets(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"needs {n} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


@pytest.mark.anyio
async def test_a_burst_of_1000_streams_through_one_gateway_has_no_error(llama_ckpt: Path, redis_url: str) -> None:
    """1000 sockets send their `generate` at once through a gateway allowed 8 Redis connections (the
    pub/sub one included): every stream gets `accepted`, its tokens in order and `done`."""
    _room_for_sockets(4 * STREAMS + 512)  # both ends of each socket live in this process
    cfg = config(redis_url, redis_max_connections=8, max_connections=STREAMS + 10)
    # The torch attention backend: no compiled kernel to wait for (its build lock is shared by every
    # process of the machine); the engine is not what this test measures.
    engine = {"max_num_seqs": 128, "num_kv_blocks": 512, "attention_backend": "torch"}
    async with running_worker(llama_ckpt, redis_url, engine) as worker, running_gateway(cfg) as gw:
        opening = asyncio.Semaphore(100)  # the listen backlog, not the thing under test

        async def open_one() -> Any:
            async with opening:
                return await connect(gw.ws_url, max_queue=None, ping_interval=None, open_timeout=60)

        sockets = await asyncio.gather(*(open_one() for _ in range(STREAMS)))
        frames: dict[str, list[dict[str, Any]]] = {}

        async def stream(i: int, ws: Any) -> None:
            rid = f"burst{i}"
            got = frames.setdefault(rid, [])
            await ws.send(json.dumps({"type": "generate", "id": rid, "prompt": "Hello", "params": PARAMS}))
            while not got or got[-1]["type"] not in ("done", "error"):
                got.append(json.loads(await ws.recv()))

        start = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(stream(i, ws) for i, ws in enumerate(sockets))), 90)
        took = time.monotonic() - start
        await asyncio.gather(*(ws.close() for ws in sockets))
        assert opened(gw.hub.redis) <= 8
        assert worker.engine.stats()["num_requests"] == 0
    errors = [f for got in frames.values() for f in got if f["type"] == "error"]
    assert errors == [], errors[:5]
    for rid, got in frames.items():
        assert without_workers(got[0]) == {"type": "accepted", "id": rid}
        assert [f["seq"] for f in got[1:]] == list(range(len(got) - 1)) and got[-1]["type"] == "done", got
        assert got[-1]["usage"]["completion_tokens"] == PARAMS["max_tokens"]
    assert gw.metrics.values["requests_total"] == STREAMS and gw.metrics.values["redis_errors_total"] == 0
    print(f"{STREAMS} streams in {took:.1f}s")
