"""Nobody waits silently for an answer that cannot come: with no live worker a client says so within
a couple of seconds (unless it asked to wait), and the gateway tells its sockets and the page."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis_worker_helpers import NAMES, running_worker

from clients import AsyncClient, Client, NoWorker


@pytest.mark.anyio
async def test_client_without_a_worker_raises_no_worker_and_withdraws_the_job(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await r.delete(NAMES.heartbeats)
    async with AsyncClient(redis_url) as client:
        started = time.monotonic()
        with pytest.raises(NoWorker) as err:
            await client.generate("hi", params={"max_tokens": 2})
        assert time.monotonic() - started < 4
        assert "no worker is serving llm:requests on " + redis_url in str(err.value)
        assert "streamer up" in str(err.value)
        assert await r.exists(NAMES.cancelled(err.value.request_id))  # it will not run later for no one
        # The message says what happened to the job: withdrawn here, never "stays queued".
        assert "the job was withdrawn" in str(err.value) and "stays queued" not in str(err.value)
    await r.aclose()


def test_blocking_client_raises_no_worker_too(redis_url: str) -> None:
    with Client(redis_url) as client:
        rid = client.submit("hi", params={"max_tokens": 2})
        with pytest.raises(NoWorker) as err:
            list(client.stream(rid, timeout=30))
    # stream() only reads: the job is still queued, and the message says so.
    assert "the job stays queued" in str(err.value) and "withdrawn" not in str(err.value)
    assert redis.Redis.from_url(redis_url).xlen(NAMES.requests) == 1


@pytest.mark.anyio
async def test_wait_for_worker_waits_for_one_that_starts_later(llama_ckpt: Path, redis_url: str) -> None:
    async with AsyncClient(redis_url) as client:
        rid = await client.submit("hi", params={"max_tokens": 3, "temperature": 0, "ignore_eos": True})
        events: list[dict] = []

        async def read() -> None:
            events.extend([e async for e in client.stream(rid, timeout=60, wait_for_worker=True)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(3)  # past the no-worker check: still waiting, as asked
            assert not events
            async with running_worker(llama_ckpt, redis_url):
                with anyio.fail_after(60):
                    while not events:
                        await anyio.sleep(0.05)
    assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.anyio
async def test_gateway_accepted_frame_says_how_many_workers_are_alive(llama_ckpt: Path, redis_url: str) -> None:
    from redis_worker_helpers import wait_for
    from test_gateway import config, recv, send
    from websockets.asyncio.client import connect

    from workers.gateway.server import running_gateway

    r = aioredis.Redis.from_url(redis_url)
    await r.delete(NAMES.heartbeats)
    await r.aclose()
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        await wait_for(lambda: gw.workers_alive is not None, 10)
        await send(ws, {"type": "generate", "id": "nobody-home", "prompt": "x", "params": {"max_tokens": 1}})
        assert await recv(ws) == {"type": "accepted", "id": "nobody-home", "workers": 0}
        await send(ws, {"type": "cancel", "id": "nobody-home"})
        async with running_worker(llama_ckpt, redis_url):
            await wait_for(lambda: gw.workers_alive == 1, 15)
            await send(ws, {"type": "generate", "id": "served", "prompt": "x", "params": {"max_tokens": 1}})
            frames = [await recv(ws, timeout=30)]
            while frames[-1].get("id") != "served":
                frames.append(await recv(ws, timeout=30))
            assert {"type": "accepted", "id": "served", "workers": 1} in frames


@pytest.mark.anyio
async def test_scale_from_zero_a_job_queued_through_the_gateway_is_served_whole_by_a_worker_started_later(
        llama_ckpt: Path, redis_url: str) -> None:
    """Kubernetes with minReplicaCount 0 (deploy/kubernetes/scaledobjects.yaml): a job pushed while no
    worker runs is told it is queued (`workers: 0`), waits in Redis, and is served in full by the
    worker KEDA starts later, the stream going on on the same socket."""
    from redis_worker_helpers import offline_tokens, wait_for
    from test_gateway import config, recv, send
    from websockets.asyncio.client import connect

    from streamer import SamplingParams
    from workers.gateway.server import running_gateway

    params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    r = aioredis.Redis.from_url(redis_url)
    await r.delete(NAMES.heartbeats)
    await r.aclose()
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        await wait_for(lambda: gw.workers_alive == 0, 10)
        await send(ws, {"type": "generate", "id": "from-zero", "prompt": "scale me", "params": params})
        assert await recv(ws) == {"type": "accepted", "id": "from-zero", "workers": 0}
        with pytest.raises(TimeoutError):  # queued, not refused and not dropped: nothing comes meanwhile
            await recv(ws, timeout=2)
        async with running_worker(llama_ckpt, redis_url):
            events = [await recv(ws, timeout=60)]
            while events[-1]["type"] not in ("done", "error"):
                events.append(await recv(ws, timeout=30))
    tokens = [t for e in events if e["type"] == "token" for t in e["token_ids"]]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert tokens == offline_tokens(llama_ckpt, ["scale me"], SamplingParams(**params))[0]
