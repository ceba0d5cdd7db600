"""Routing and priority for jobs from any submitter (docs/scheduling.md): jobs pushed by the real
redis-cli binary with a plain `XADD llm:requests`, real workers. A session's follow-up sent the moment
its previous answer ends (no think time, as an agent after a tool call) is served by the worker
holding the session's KV, across three workers, whichever worker reads it; a forwarded job's stream
is the one a direct run gives; a raw job whose priority is below a lane's cutoff overtakes a backlog."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis_worker_helpers import check_complete, has_ended, read_events, running_worker, wait_for

from clients.names import Names
from clients.redis_client import AsyncClient
from workers.worker.redis_worker import Worker

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NAMES = Names()
BLOCK = 16  # the test engine's block size (redis_worker_helpers.ENGINE)


async def redis_cli_xadd(url: str, job: dict[str, Any], stream: str = NAMES.requests) -> None:
    """The push of the README's redis-cli example, by the real binary."""
    proc = await asyncio.create_subprocess_exec("redis-cli", "-u", url, "XADD", stream, "*", "json",
                                                json.dumps({"v": 1, **job}), stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0 and b"-" in out, out


async def turn(submitter: str, url: str, client: AsyncClient, messages: list[dict[str, str]],
               session: str) -> tuple[str, list[dict[str, Any]]]:
    """One call of a session, pushed by redis-cli or by the Python client (which routes it), and its
    events, read to the end."""
    params = {**GREEDY, "max_tokens": 8}
    if submitter == "redis-cli":
        rid = uuid.uuid4().hex
        await redis_cli_xadd(url, {"id": rid, "messages": messages, "session": session, "params": params})
    else:
        rid = await client.submit(messages=messages, params=params, session=session)
    return rid, [e async for e in client.stream(rid, timeout=60)]


def forwards(worker: Worker) -> float:
    return worker.metrics.registry.get_sample_value("streamer_worker_session_forwards_total",
                                                    {"worker": worker.cfg.consumer}) or 0.0


@pytest.mark.parametrize("submitter", ["redis-cli", "python"])
@pytest.mark.anyio
async def test_immediate_follow_ups_reach_the_sessions_worker_across_three(llama_ckpt: Path, redis_url: str,
                                                                          submitter: str) -> None:
    """Six sessions, one after another: a first call and, the moment its `done` arrives, the follow-up
    (the conversation so far). Each session's system prompt is its own, so a follow-up's prompt is in
    no cache but its session's worker's: its cached tokens say who served it. Pushed raw, idle workers
    wait on the shared lane together and the one that just answered waits last, so most follow-ups are
    read by another worker and must be forwarded; the Python client routes them to the session's
    worker itself, which it can only because that worker wrote the session when it took the first call."""
    sessions = 6
    r = redis.Redis.from_url(redis_url)
    async with running_worker(llama_ckpt, redis_url, consumer="w-a") as wa, \
            running_worker(llama_ckpt, redis_url, consumer="w-b") as wb, \
            running_worker(llama_ckpt, redis_url, consumer="w-c") as wc, AsyncClient(redis_url) as client:
        workers = {"w-a": wa, "w-b": wb, "w-c": wc}
        await wait_for(lambda: len(r.zrange(NAMES.heartbeats, 0, -1)) == 3, timeout=10)
        served = []
        for i in range(sessions):
            session = f"agent-{i}"
            messages = [{"role": "system", "content": f"Agent {i} of the follow-up test, working alone."},
                        {"role": "user", "content": "Call the tool."}]
            _, first = await turn(submitter, redis_url, client, messages, session)
            holder = r.get(NAMES.session(session)).decode()  # written when the job was taken
            text = "".join(e.get("text", "") for e in first if e["type"] == "token")
            follow = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "Result: 42."}]
            rid, second = await turn(submitter, redis_url, client, follow, session)
            prompt = check_complete(first)["usage"]["prompt_tokens"]
            assert prompt > 2 * BLOCK  # whole blocks of it are cached where it ran
            cached = check_complete(second)["usage"]["cached_tokens"]
            served.append((holder, cached >= prompt - BLOCK, r.get(NAMES.session(session)).decode()))
            if submitter == "python":
                assert client._placements[rid].stream == NAMES.worker_requests(holder)
        moved = {name: forwards(w) for name, w in workers.items()}
        finished = {name: w.engine.stats()["num_requests_finished"] for name, w in workers.items()}
    print(f"follow-ups on their session's worker: {sum(hit for _, hit, _ in served)}/{sessions}; "
          f"forwarded by each worker: {moved}")
    assert all(hit for _, hit, _ in served), served
    assert all(holder == after for holder, _, after in served), served
    if submitter == "redis-cli":  # the path under test was taken (all six read by their holder: < 0.2%)
        assert sum(moved.values()) >= 1
    holders = [holder for holder, _, _ in served]
    assert finished == {name: 2 * holders.count(name) for name in workers}
    r.close()


@pytest.mark.anyio
async def test_a_forwarded_job_streams_what_a_direct_run_does(llama_ckpt: Path, redis_url: str) -> None:
    """w-a holds the session and both its seats are busy, so w-b reads the raw job: it forwards it to
    w-a's stream (w-a has room: a freed seat is a job away), and w-a serves it once. Its events equal
    those of the same job run directly, without a session."""
    r = redis.Redis.from_url(redis_url)
    job = {"prompt": "The forwarded job says", "params": {**GREEDY, "max_tokens": 24}}
    async with running_worker(llama_ckpt, redis_url, consumer="w-a", engine={"max_num_seqs": 2}) as wa, \
            running_worker(llama_ckpt, redis_url, consumer="w-b") as wb, AsyncClient(redis_url) as client:
        await wait_for(lambda: len(r.zrange(NAMES.heartbeats, 0, -1)) == 2, timeout=10)
        busy = [uuid.uuid4().hex for _ in range(2)]
        for rid in busy:  # routed to w-a by hand: both its seats taken for a while
            await redis_cli_xadd(redis_url, {"id": rid, "prompt": "busy", "params": {**GREEDY, "max_tokens": 400}},
                                 NAMES.worker_requests("w-a"))
        await wait_for(lambda: all(r.exists(NAMES.events(rid)) for rid in busy), timeout=30, interval=0.01)
        r.set(NAMES.session("fwd"), "w-a")  # as w-a wrote when it served the session's last call
        await redis_cli_xadd(redis_url, {"id": "forwarded", "session": "fwd", **job})
        forwarded = [e async for e in client.stream("forwarded", timeout=60)]
        assert forwards(wb) == 1 and forwards(wa) == 0
        await redis_cli_xadd(redis_url, {"id": "direct", **job})
        direct = [e async for e in client.stream("direct", timeout=60)]
        for rid in busy:
            await wait_for(lambda rid=rid: has_ended(redis_url, rid), timeout=60)
        await wait_for(lambda: wa.engine.stats()["num_requests_finished"] >= 3, timeout=10)
        assert r.get(NAMES.session("fwd")) == b"w-a"
    assert read_events(redis_url, "forwarded") == forwarded  # every event once, seq contiguous
    check_complete(forwarded)

    def comparable(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in e.items() if k != "id"},
                 **({"usage": {**e["usage"], "cached_tokens": 0}} if "usage" in e else {})} for e in events]

    assert comparable(forwarded) == comparable(direct)
    # Nothing left behind: the shared lane, w-a's own stream and every pending list are empty.
    for stream in (NAMES.requests, NAMES.worker_requests("w-a"), NAMES.worker_requests("w-b")):
        assert r.xlen(stream) == 0 and r.xpending(stream, NAMES.group)["pending"] == 0, stream
    r.close()


@pytest.mark.anyio
async def test_a_raw_urgent_job_overtakes_a_backlog(llama_ckpt: Path, redis_url: str) -> None:
    """A worker started with lanes (--priority-lanes -1). 200 raw jobs wait in the default lane; one
    pushed last by redis-cli with priority -5 is moved into the urgent lane and starts before every
    job the worker did not already hold."""
    r = redis.Redis.from_url(redis_url)
    seats = 2
    async with running_worker(llama_ckpt, redis_url, engine={"max_num_seqs": seats}, names=Names(lanes=(-1,))), \
            AsyncClient(redis_url) as client:
        backlog = [f"backlog-{i}" for i in range(200)]
        with r.pipeline(transaction=False) as pipe:
            for rid in backlog:
                pipe.xadd(NAMES.requests, {"json": json.dumps({"v": 1, "id": rid, "prompt": f"job {rid}",
                                                               "params": {**GREEDY, "max_tokens": 6}})})
            pipe.execute()

        def started() -> set[str]:
            with r.pipeline(transaction=False) as pipe:
                for rid in backlog:
                    pipe.exists(NAMES.events(rid))
                return {rid for rid, found in zip(backlog, pipe.execute(), strict=True) if found}

        await wait_for(lambda: len(started()) >= seats, timeout=30, interval=0.01)
        before = started()
        await redis_cli_xadd(redis_url, {"id": "urgent", "prompt": "urgent job", "priority": -5,
                                         "params": {**GREEDY, "max_tokens": 6}})
        await wait_for(lambda: r.exists(NAMES.events("urgent")), timeout=30, interval=0.005)
        overtaken = started() - before
        with anyio.fail_after(60):
            events = [e async for e in client.stream("urgent", timeout=30)]
    # Jobs the worker held when the urgent one came (its seats and at most one read ahead) may start
    # first; without the move about 198 would.
    assert len(overtaken) <= seats + 1, sorted(overtaken)
    assert check_complete(events)["finish_reason"] == "length"
    r.close()
