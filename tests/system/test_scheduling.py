"""Many workers as one server (docs/scheduling.md): priority lanes under a backlog, tenants' fair
shares, session affinity and cache-aware routing, a routed job's worker killed, and the plain
`XADD llm:requests` of the protocol still served. Real redis-server, real workers."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import anyio
import pytest
import redis
from redis_worker_helpers import (
    check_complete,
    kill_all,
    long_context_checkpoint,
    offline_tokens,
    read_events,
    running_worker,
    tokens_of,
    wait_for,
    worker_process,
)

from clients.names import Names
from clients.redis_client import AsyncClient
from clients.routing import prefix_chain
from streamer import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SYSTEM = "You are the scheduling test's assistant. " * 12  # ~500 characters: a prefix worth routing


NAMES = Names()


def started(r: redis.Redis, ids: list[str]) -> set[str]:
    """The jobs that have written an event (they were taken and began)."""
    with r.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.exists(NAMES.events(rid))
        return {rid for rid, found in zip(ids, pipe.execute(), strict=True) if found}


@pytest.mark.anyio
async def test_an_urgent_job_overtakes_a_backlog_of_200(llama_ckpt: Path, redis_url: str) -> None:
    """200 jobs wait in the default lane; one submitted last at priority -5 waits in the urgent lane
    and is the next job taken when a slot frees: at most the jobs already held by the worker start
    before it (not the 200)."""
    names = Names(lanes=(-1,))
    r = redis.Redis.from_url(redis_url)
    seats = 2
    async with running_worker(llama_ckpt, redis_url, engine={"max_num_seqs": seats}), \
            AsyncClient(redis_url, names=names) as client:
        backlog = [await client.submit(f"backlog job {i}", params={**GREEDY, "max_tokens": 6}) for i in range(200)]
        await wait_for(lambda: len(started(r, backlog)) >= seats, timeout=30, interval=0.01)
        before = started(r, backlog)
        urgent = await client.submit("urgent job", params={**GREEDY, "max_tokens": 6}, priority=-5)
        assert client._placements[urgent].stream == names.lane_for(-5)[0] == "llm:requests:prio-1"
        await wait_for(lambda: r.exists(names.events(urgent)), timeout=30, interval=0.005)
        overtaken = started(r, backlog) - before
        events = [e async for e in client.stream(urgent, timeout=30)]
    # Jobs the worker held when the urgent one came in (its seats and at most one read ahead) may
    # start first; without lanes about 198 would.
    assert len(overtaken) <= seats + 1, sorted(overtaken)
    assert check_complete(events)["finish_reason"] == "length"
    r.close()


async def tokens_by_tenant(r: redis.Redis, ids: dict[str, list[str]], names: Names) -> dict[str, int]:
    """Tokens generated so far for each tenant's jobs (read from their event streams)."""
    counts = {}
    for tenant, rids in ids.items():
        with r.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xlen(names.events(rid))
            counts[tenant] = sum(pipe.execute())  # one token per event (and one done per finished job)
    return counts


@pytest.mark.anyio
async def test_two_tenants_share_a_saturated_worker_three_to_one(llama_ckpt: Path, redis_url: str) -> None:
    names = Names()
    r = redis.Redis.from_url(redis_url)
    r.hset(names.tenants, mapping={"gold": 3, "bronze": 1})  # what a gateway writes from its keys file
    params = {**GREEDY, "max_tokens": 12}
    async with running_worker(llama_ckpt, redis_url, engine={"max_num_seqs": 4}), \
            AsyncClient(redis_url) as client:
        ids = {"bronze": [], "gold": []}
        for i in range(150):  # both queues stay backlogged through the measurement
            for tenant in ids:
                # The same prompt for both: shares hold in prompt + output tokens, so jobs of
                # different sizes would shift the ratio of output tokens.
                ids[tenant].append(await client.submit(f"job {i}", params=params, tenant=tenant))
        assert client._placements[ids["gold"][0]].stream == "llm:requests:t:gold"

        async def counts_at(total: int) -> dict[str, int]:
            while sum((counts := await tokens_by_tenant(r, ids, names)).values()) < total:
                await anyio.sleep(0.05)
            return counts

        # Measured over a window after the first jobs (whose order the fair share has not shaped
        # yet), long enough that the up to 4 jobs in flight at each end weigh little.
        with anyio.fail_after(180):
            first, last = await counts_at(200), await counts_at(1800)
    assert min(len(started(r, v)) for v in ids.values()) < 150, "both tenants still had a backlog"
    ratio = (last["gold"] - first["gold"]) / (last["bronze"] - first["bronze"])
    assert 2.7 <= ratio <= 3.3, (first, last)
    r.close()


@pytest.mark.anyio
async def test_a_sessions_next_call_goes_to_the_worker_holding_its_cache(llama_ckpt: Path, redis_url: str) -> None:
    """Two workers. A session's first call is taken by either; its second call (the conversation so
    far, the first answer included) is routed to that worker's own stream and hits its prefix cache.
    A new session sharing only the long system prompt is routed there as well (a prefix hit)."""
    names = Names()
    params = {**GREEDY, "max_tokens": 8}
    async with running_worker(llama_ckpt, redis_url, consumer="w-a") as wa, \
            running_worker(llama_ckpt, redis_url, consumer="w-b") as wb, AsyncClient(redis_url) as client:
        workers = {"w-a": wa, "w-b": wb}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}]
        first = await client.generate(messages=messages, params=params, session="conv-1")
        r = redis.Redis.from_url(redis_url)
        await wait_for(lambda: r.get(names.session("conv-1")) is not None, timeout=10)
        home = r.get(names.session("conv-1")).decode()
        await wait_for(lambda: r.sismember(names.worker_prefixes(home), prefix_chain({"messages": messages})[0].digest),
                       timeout=10)
        follow = [*messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And?"}]
        second = await client.generate(messages=follow, params=params, session="conv-1")
        assert client._placements[second.id].stream == names.worker_requests(home)
        assert second.usage["cached_tokens"] > first.usage["cached_tokens"]
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Unrelated question?"}]
        third = await client.generate(messages=other, params=params, session="conv-2")
        assert client._placements[third.id].stream == names.worker_requests(home)
        assert third.usage["cached_tokens"] > 0
        assert client.router.outcomes["session"] == 1 and client.router.outcomes["hit"] == 1
        await wait_for(lambda: workers[home].engine.stats()["num_requests_finished"] == 3, timeout=10)
        assert all(w.engine.stats()["num_requests_finished"] == 0 for n, w in workers.items() if n != home)
        r.close()


@pytest.mark.anyio
async def test_a_routed_jobs_worker_killed_mid_answer(tmp_path: Path, redis_url: str) -> None:
    """A job routed to a worker's own stream (its session lives there) survives that worker's SIGKILL:
    another worker takes it over and the client's stream has every token once, equal to an
    uninterrupted run."""
    ckpt = long_context_checkpoint(tmp_path / "long")
    names = Names()
    r = redis.Redis.from_url(redis_url)
    procs = {name: worker_process(ckpt, redis_url, "--consumer", name, "--claim-idle", "1.5", "--grace", "5",
                                  log_path=tmp_path / f"{name}.log") for name in ("w-a", "w-b")}
    params = {**GREEDY, "max_tokens": 600}
    prompt = "The routed job " * 30
    try:
        expected = offline_tokens(ckpt, [prompt], SamplingParams(**params))[0]
        await wait_for(lambda: len(r.zrange(names.heartbeats, 0, -1)) == 2, timeout=60, interval=0.1)
        r.set(names.session("kill-me"), "w-a")  # as w-a writes once it served the session
        async with AsyncClient(redis_url) as client:
            rid = await client.submit(prompt, params=params, session="kill-me")
            assert client._placements[rid].stream == names.worker_requests("w-a")
            await wait_for(lambda: len(read_events(redis_url, rid)) >= 5, timeout=60, interval=0.02)
            procs["w-a"].send_signal(signal.SIGKILL)
            procs["w-a"].wait(10)
            events = [e async for e in client.stream(rid, timeout=60)]
        procs["w-b"].send_signal(signal.SIGTERM)
        assert procs["w-b"].wait(30) == 0
    finally:
        kill_all(procs)
        for name in procs:  # shown when the test fails
            print(f"--- {name}'s log ---\n" + (tmp_path / f"{name}.log").read_text()[-4000:])
    stored = read_events(redis_url, rid)  # seq contiguous (checked against the stream ids)
    assert events == stored
    assert check_complete(stored)["finish_reason"] == "length"
    assert tokens_of(stored) == expected
    assert "reclaimed job entry" in (tmp_path / "w-b.log").read_text()
    r.close()


@pytest.mark.anyio
async def test_a_plain_xadd_to_the_requests_stream_is_still_served(llama_ckpt: Path, redis_url: str) -> None:
    """The protocol's documented push, with lanes, tenants and routing all in use around it."""
    names = Names(lanes=(-1,))
    r = redis.Redis.from_url(redis_url)
    r.hset(names.tenants, "t1", 2)
    async with running_worker(llama_ckpt, redis_url, consumer="w-a"), running_worker(llama_ckpt, redis_url,
                                                                                     consumer="w-b"), \
            AsyncClient(redis_url, names=names) as client:
        urgent = await client.submit("urgent", params={**GREEDY, "max_tokens": 3}, priority=-3, tenant="t1")
        r.xadd("llm:requests", {"json": json.dumps({"v": 1, "id": "plain-1", "prompt": "hello", "params":
                                                    {**GREEDY, "max_tokens": 4}})})
        plain = [e async for e in client.stream("plain-1", timeout=30)]
        rest = [e async for e in client.stream(urgent, timeout=30)]
    assert len(tokens_of(plain)) == 4 and check_complete(plain)["finish_reason"] == "length"
    assert len(tokens_of(rest)) == 3
    r.close()


@pytest.mark.anyio
async def test_a_tenants_slot_is_freed_by_the_worker_when_its_job_ends(llama_ckpt: Path, redis_url: str) -> None:
    """Gateway and worker together: a tenant allowed one job at a time gets 429 while its job runs,
    and is admitted again once the worker has finished it (the worker frees the slot, not a timeout)."""
    import httpx
    from test_gateway import config

    from workers.gateway.keys_file import TenantLimits
    from workers.gateway.server import running_gateway

    gw_config = config(redis_url, api_keys=("k1",), tenants={"solo": TenantLimits(max_concurrent=1)},
                       key_tenants={"k1": "solo"})
    body = {"model": str(llama_ckpt), "prompt": "tenant slot", "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "stream": True}
    r = redis.Redis.from_url(redis_url)
    async with running_worker(llama_ckpt, redis_url), running_gateway(gw_config) as gw, \
            httpx.AsyncClient(base_url=gw.url + "v1", headers={"Authorization": "Bearer k1"}, timeout=30) as http:
        async with http.stream("POST", "/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            await anext(lines)  # the first chunk: the job runs
            refused = await http.post("/completions", json={**body, "stream": False})
            assert refused.status_code == 429 and refused.headers["retry-after"]
            rest = [line async for line in lines]
        assert "data: [DONE]" in rest
        await wait_for(lambda: r.zcard(NAMES.tenant_active("solo")) == 0, timeout=10)
        again = await http.post("/completions", json={**body, "stream": False, "max_tokens": 4})
        assert again.status_code == 200, again.text
    r.close()
