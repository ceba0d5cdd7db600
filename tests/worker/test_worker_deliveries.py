"""Delivery counting at its limits: the max-th delivery of a job still runs and the next one is
dead-lettered (`--max-deliveries 1`: a job runs once), and live workers that are busy for several
claim-idle periods take none of each other's jobs (the idle threshold is in the right unit). Real
redis-server, real in-process workers on the tiny Llama."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
import redis
from redis_worker_helpers import (
    check_complete,
    dead_letters,
    has_ended,
    long_context_checkpoint,
    read_events,
    running_worker,
    wait_for,
)

from clients.protocol import Names, encode_job
from clients.redis_client import AsyncClient

NAMES = Names()
SHORT = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def push_delivered(r: redis.Redis, rid: str, earlier: int) -> str:
    """A job that `earlier` workers, all dead now, were handed before (read once, then claimed); its
    entry id."""
    entry = r.xadd(NAMES.requests, encode_job({"id": rid, "prompt": "hi", "params": SHORT}))
    for k in range(earlier):
        if k == 0:
            r.xreadgroup(NAMES.group, "dead-0", {NAMES.requests: ">"})
        else:
            r.xclaim(NAMES.requests, NAMES.group, f"dead-{k}", 0, [entry])
    return entry.decode()


@pytest.mark.anyio
@pytest.mark.parametrize("max_deliveries", [1, 3])
async def test_the_max_th_delivery_runs_and_the_next_is_dead(llama_ckpt: Path, redis_url: str,
                                                              max_deliveries: int,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamer.worker")
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    earlier = {"one-too-many": max_deliveries, "last-chance": max_deliveries - 1}
    # A ghost's read takes every new entry: a fresh job (0 earlier deliveries) goes last.
    entries = {rid: push_delivered(r, rid, n) for rid, n in earlier.items()}
    async with running_worker(llama_ckpt, redis_url, claim_idle_s=0.3, max_deliveries=max_deliveries):
        await wait_for(lambda: all(has_ended(redis_url, rid) for rid in earlier), timeout=30)
    assert check_complete(read_events(redis_url, "last-chance"))["type"] == "done"
    assert [(e["type"], e["code"]) for e in read_events(redis_url, "one-too-many")] == [
        ("error", "too_many_deliveries")]
    assert [d["id"] for d in dead_letters(redis_url)] == [b"one-too-many"]
    # Each answered, each entry acked where it was: a job taken over is acked under its own entry id.
    assert r.xlen(NAMES.requests) == 0 and r.xpending(NAMES.requests, NAMES.group)["pending"] == 0
    # The operator's log names each entry taken over and its delivery (this worker's claim included).
    assert f"reclaimed job entry {entries['one-too-many']} (delivery {max_deliveries + 1})" in caplog.text
    r.close()


CLAIM_IDLE_S = 1.0
PERIODS = 4  # claim-idle periods both workers stay busy for
WORKERS = ("w-a", "w-b")
LONG = {"max_tokens": 8000, "temperature": 0.0, "ignore_eos": True}  # outlasts the periods (cancelled then)


def pending(r: redis.Redis) -> list[tuple[bytes, bytes, int]]:
    """(stream, consumer, times delivered) of every entry the workers hold, from their own streams."""
    return [(stream.encode(), p["consumer"], p["times_delivered"]) for stream in map(NAMES.worker_requests, WORKERS)
            for p in r.xpending_range(stream, NAMES.group, "-", "+", 10)]


@pytest.mark.anyio
async def test_live_busy_workers_take_none_of_each_others_jobs(redis_url: str, tmp_path: Path) -> None:
    """Each worker's reclaimer looks every half claim-idle period, with seats to spare, at the other
    one's stream, whose entry the other keeps fresh with its heartbeat. None may be taken over:
    every entry stays with its worker, delivered once."""
    r = redis.Redis.from_url(redis_url)
    ckpt = long_context_checkpoint(tmp_path / "ckpt")  # room for jobs that outlast the periods
    engine = {"num_kv_blocks": 1100}
    async with running_worker(ckpt, redis_url, engine=engine, claim_idle_s=CLAIM_IDLE_S, consumer=WORKERS[0]), \
            running_worker(ckpt, redis_url, engine=engine, claim_idle_s=CLAIM_IDLE_S, consumer=WORKERS[1]), \
            AsyncClient(redis_url) as client:
        for name in WORKERS:  # routed to each worker, as a submitter routing by cache or session does
            r.xadd(NAMES.worker_requests(name), encode_job({"id": f"job-{name}", "prompt": "x", "params": LONG}))
        ids = [f"job-{name}" for name in WORKERS]
        await wait_for(lambda: all(read_events(redis_url, rid) for rid in ids), timeout=30)
        before = pending(r)
        await anyio.sleep(PERIODS * CLAIM_IDLE_S)
        after = pending(r)
        ended = [rid for rid in ids if has_ended(redis_url, rid)]
        for rid in ids:
            await client.cancel(rid)
    want = [(NAMES.worker_requests(name).encode(), name.encode(), 1) for name in WORKERS]
    assert before == want and after == want, (before, after)
    assert not ended, "a job ended early: the test saw no busy period"
    r.close()
