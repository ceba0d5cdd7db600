"""Crash safety: a worker killed mid-generation, a Redis restart, a SIGTERM shutdown. Nothing is lost,
nothing is sent twice, and every client stream has the tokens of an uninterrupted run."""

import signal
import subprocess
import sys

import anyio
import pytest
import redis
from redis_worker_helpers import (
    check_complete,
    kill_all,
    long_context_checkpoint,
    offline_completions,
    offline_tokens,
    read_events,
    running_worker,
    text_of,
    tokens_of,
    wait_for,
    worker_process,
)

from clients.protocol import Names, decode_job
from clients.redis_client import AsyncClient
from streamer import SamplingParams
from workers.redis_server import RedisServer

LONG = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 400, "temperature": 0.9, "seed": 7, "ignore_eos": True}
NAMES = Names()


def prompts(n):
    return [f"job {i}: the paged cache" + " stores blocks" * (i % 3) for i in range(n)]


async def collect_all(url, ids, timeout):
    """Each request's whole event list through the client's stream (which survives Redis drops)."""
    results = {}
    async with AsyncClient(url) as client:

        async def one(rid):
            results[rid] = [e async for e in client.stream(rid, timeout=timeout)]

        with anyio.fail_after(timeout * 2):
            async with anyio.create_task_group() as tg:
                for rid in ids:
                    tg.start_soon(one, rid)
    return results


def in_progress(r, url, consumer):
    """Ids of this consumer's jobs that have sent tokens but are not finished."""
    found = []
    for p in r.xpending_range(NAMES.requests, NAMES.group, "-", "+", 100, consumername=consumer):
        entry = r.xrange(NAMES.requests, p["message_id"], p["message_id"])
        if entry:
            rid = decode_job(entry[0][1]).id
            events = read_events(url, rid)
            if events and events[-1]["type"] == "token":
                found.append(rid)
    return found


@pytest.mark.anyio
async def test_sigkill_one_of_two_workers(llama_ckpt, redis_url, tmp_path):
    texts = prompts(4)
    r = redis.Redis.from_url(redis_url)
    procs = {name: worker_process(llama_ckpt, redis_url, "--consumer", name, "--claim-idle", "1.5",
                                  "--grace", "5", log_path=tmp_path / f"{name}.log")
             for name in ("w-a", "w-b")}
    try:
        # The uninterrupted run to compare with, computed while the workers start.
        expected = offline_completions(llama_ckpt, texts, SamplingParams(**LONG))
        expected_seeded = offline_completions(llama_ckpt, texts[:1], SamplingParams(**SEEDED))[0]
        await wait_for(lambda: len(r.keys(NAMES.worker("*"))) == 2, timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            ids = [await client.submit(t, params=LONG) for t in texts]
            ids.append(await client.submit(texts[0], params=SEEDED))
        victim, partial = None, []
        with anyio.fail_after(30):
            while not partial:
                for name in procs:
                    if partial := in_progress(r, redis_url, name):
                        victim = name
                        break
                await anyio.sleep(0.02)
        procs[victim].kill()  # SIGKILL: no cleanup at all
        procs[victim].wait(10)
        results = await collect_all(redis_url, ids, timeout=60)
        survivor = next(n for n in procs if n != victim)
        # The survivor stops cleanly on SIGTERM.
        procs[survivor].send_signal(signal.SIGTERM)
        assert procs[survivor].wait(30) == 0, (tmp_path / f"{survivor}.log").read_text()[-3000:]
    finally:
        kill_all(procs)
    assert partial, "a job was killed mid-generation"
    for rid, (exp_tokens, exp_text) in zip(ids, [*expected, expected_seeded], strict=True):
        events = read_events(redis_url, rid)  # contiguous seq, checked against the stream ids
        assert results[rid] == events
        assert check_complete(events)["finish_reason"] == "length", rid
        assert tokens_of(events) == exp_tokens, rid
        assert text_of(events) == exp_text, rid
    assert r.xlen(NAMES.requests) == 0 and not r.xpending(NAMES.requests, NAMES.group)["pending"]
    survivor_log = (tmp_path / f"{survivor}.log").read_text()
    assert "reclaimed job entry" in survivor_log
    r.close()


@pytest.mark.anyio
async def test_redis_restart_during_run(llama_ckpt):
    texts = prompts(4)
    expected = offline_tokens(llama_ckpt, texts, SamplingParams(**LONG))
    with RedisServer(appendonly=True) as server:
        async with running_worker(llama_ckpt, server.url), AsyncClient(server.url) as client:
            ids = [await client.submit(t, params=LONG) for t in texts]
            await wait_for(lambda: any(read_events(server.url, rid) for rid in ids), timeout=20)
            async with anyio.create_task_group() as tg:
                results = {}

                async def gather():
                    results.update(await collect_all(server.url, ids, timeout=60))

                tg.start_soon(gather)
                unfinished = [rid for rid in ids if not read_events(server.url, rid)[-1:]
                              or read_events(server.url, rid)[-1]["type"] == "token"]
                await anyio.to_thread.run_sync(server.restart, 0.5)
        assert unfinished, "Redis restarted while jobs were generating"
        for rid, exp in zip(ids, expected, strict=True):
            events = read_events(server.url, rid)
            assert results[rid] == events
            assert check_complete(events)["type"] == "done", rid
            assert tokens_of(events) == exp, rid


@pytest.mark.anyio
async def test_sigterm_finishes_in_flight_jobs(llama_ckpt, redis_url, tmp_path):
    log = tmp_path / "w.log"
    proc = worker_process(llama_ckpt, redis_url, "--grace", "30", log_path=log)
    r = redis.Redis.from_url(redis_url)
    try:
        await wait_for(lambda: r.keys(NAMES.worker("*")), timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            ids = [await client.submit(t, params=LONG) for t in prompts(3)]
            await wait_for(lambda: all(read_events(redis_url, rid) for rid in ids), timeout=20)
            proc.send_signal(signal.SIGTERM)
            late = await client.submit("sent after SIGTERM", params=LONG)
            results = await collect_all(redis_url, ids, timeout=30)
            assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for rid in ids:
        assert check_complete(results[rid])["finish_reason"] == "length"
        assert len(tokens_of(results[rid])) == LONG["max_tokens"]
    # The job pushed after SIGTERM was not taken: it waits in Redis for another worker.
    assert not r.exists(NAMES.events(late))
    assert r.xlen(NAMES.requests) == 1 and not r.keys(NAMES.worker("*"))
    r.close()


def test_worker_cli_refuses_missing_redis(llama_ckpt):
    from workers.redis_server import free_port

    out = subprocess.run([sys.executable, "-m", "workers.cli", "worker", "--model", str(llama_ckpt),
                          "--redis", f"redis://127.0.0.1:{free_port()}/0"], capture_output=True, timeout=60)
    assert out.returncode == 2
    assert b"cannot reach Redis" in out.stderr and b"Traceback" not in out.stderr


@pytest.fixture(scope="module")
def long_context_ckpt(tmp_path_factory):
    return long_context_checkpoint(tmp_path_factory.mktemp("llama16k"))


@pytest.mark.anyio
async def test_inflight_entries_stay_fresh_and_a_takeover_stops_the_job(long_context_ckpt, redis_url):
    """A live worker's jobs are never reclaimable, however long they run; if another worker takes one
    over anyway (it thought this one dead), this worker stops it instead of racing."""
    r = redis.Redis.from_url(redis_url)
    async with running_worker(long_context_ckpt, redis_url, engine={"num_kv_blocks": 2100}, claim_idle_s=1.0,
                              heartbeat_s=0.1) as worker, AsyncClient(redis_url) as client:
        # 2 samples x 16000 tokens: far longer than the 2 s watched below, on any machine.
        rid = await client.submit("a long one", params={**LONG, "max_tokens": 16000, "n": 2})
        await wait_for(lambda: read_events(redis_url, rid), timeout=20)
        for _ in range(20):  # 2 s: twice the idle time after which entries are reclaimed
            taken = r.xautoclaim(NAMES.requests, NAMES.group, "thief", 1000, count=10)[1]
            assert taken == [], f"a running job's entry went idle: {worker.stats()}"
            await anyio.sleep(0.1)
        assert worker.engine.stats()["num_requests"] == 1, "the job is still running"
        entry = r.xpending_range(NAMES.requests, NAMES.group, "-", "+", 1)[0]["message_id"]
        r.xclaim(NAMES.requests, NAMES.group, "thief", 0, [entry])  # forced takeover
        await wait_for(lambda: worker.engine.stats()["num_requests"] == 0, timeout=10)
        events = read_events(redis_url, rid)
        assert events[-1]["type"] == "token", "the job was left to its new owner, not answered"
        assert r.xpending_range(NAMES.requests, NAMES.group, "-", "+", 1)[0]["consumer"] == b"thief"
    r.close()


@pytest.mark.anyio
async def test_a_worker_claiming_its_own_running_entry_leaves_the_job_alone(llama_ckpt, redis_url):
    """After a Redis outage longer than --claim-idle, the entries of a live worker's own running jobs
    are idle enough for its reclaimer too: XAUTOCLAIM hands them back to it. That must not start
    the job a second time (the engine would refuse the id, the client would get an error in the
    middle of a healthy stream, and the new claim would fence the running copy off)."""
    r = redis.Redis.from_url(redis_url)
    params = {**LONG, "max_tokens": 300}
    async with running_worker(llama_ckpt, redis_url) as worker, AsyncClient(redis_url) as client:
        rid = await client.submit("mine", params=params)
        await wait_for(lambda: len(read_events(redis_url, rid)) >= 2, timeout=20)
        async with anyio.create_task_group() as tg:  # as the claim loop does, with every entry idle enough
            await worker.reclaimer._claim_stream(NAMES.requests, 0, tg)
        events = [e async for e in client.stream(rid, timeout=60)]
    assert [e["type"] for e in events].count("error") == 0
    assert events[-1]["type"] == "done" and len(tokens_of(events)) == 300
    assert r.hget(NAMES.fence(rid), "epoch") == b"1"  # never claimed a second time
    r.close()


@pytest.mark.anyio
async def test_cancel_marker_reaches_a_running_job(long_context_ckpt, redis_url):
    """A cancel whose PUBLISH nobody heard (pub/sub reconnecting) still stops the job."""
    r = redis.Redis.from_url(redis_url)
    async with running_worker(long_context_ckpt, redis_url, engine={"num_kv_blocks": 1100}), \
            AsyncClient(redis_url) as client:
        rid = await client.submit("stop me", params={**LONG, "max_tokens": 16000})
        await wait_for(lambda: read_events(redis_url, rid), timeout=20)
        r.set(NAMES.cancelled(rid), 1)  # the marker only, no PUBLISH
        events = [e async for e in client.stream(rid, timeout=10)]
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "abort"
    r.close()


@pytest.mark.anyio
async def test_worker_survives_redis_losing_its_data(long_context_ckpt):
    """Without AOF a restart loses the group and the jobs: the worker recreates the group and serves on."""
    with RedisServer() as server:
        async with running_worker(long_context_ckpt, server.url, engine={"num_kv_blocks": 1100}) as worker, \
                AsyncClient(server.url) as client:
            await client.submit("lost with the data", params={**LONG, "max_tokens": 16000})
            await wait_for(lambda: worker.stats()["jobs"] == 1, timeout=20)
            await anyio.to_thread.run_sync(server.restart, 0.2)
            after = await client.generate("after the restart", params=LONG, timeout=30)
            assert len(after.token_ids[0]) == LONG["max_tokens"]
            assert not worker.stopping
