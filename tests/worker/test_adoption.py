"""Jobs routed to a worker that cannot serve them (workers/worker/reclaim.py, docs/scheduling.md): a
live worker's reclaimer takes those of a dead worker (no fresh heartbeat) and those a live worker has
left unread for longer than claim_idle_s (stalled), and removes a dead worker's stream, its load and its
advertised prefixes once the stream is empty and the worker has been gone for consumer_idle_s. Real
redis-server and a real in-process worker on the tiny Llama; the other workers are played by the test
(their heartbeats, streams and groups), as test_bounded_redis.py plays crashed consumers."""

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
    redis_now_ms,
    running_worker,
    wait_for,
)

from clients.protocol import Names, encode_job
from clients.redis_client import AsyncClient

NAMES = Names()
CLAIM_IDLE_S = 0.4  # the reclaimer looks every 0.2 s
SHORT = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_tokens": 8000, "temperature": 0.0, "ignore_eos": True}  # runs until cancelled


def routed_to(r: redis.Redis, worker: str, request_id: str, last_beat_ms: int, params: dict,
              entry_id: str = "*") -> None:
    """A job routed to `worker`, which registered its stream (with its last beat) and made its group
    there before it stopped reading."""
    stream = NAMES.worker_requests(worker)
    r.xgroup_create(stream, NAMES.group, id="0", mkstream=True)
    r.zadd(NAMES.worker_streams, {worker: last_beat_ms})
    r.xadd(stream, encode_job({"id": request_id, "prompt": "hi", "params": params}), id=entry_id)


async def looks_pass() -> None:
    """Several passes of the reclaimer."""
    await anyio.sleep(3 * CLAIM_IDLE_S)


@pytest.mark.anyio
async def test_a_dead_workers_job_waits_for_a_seat_and_its_stream_goes_once_empty(
        redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One seat. While it is taken by a job of the shared stream, the dead worker's job stays unread in
    its stream, and the stream stays; once the seat is free the job runs here, and while it runs (its
    entry pending there) the stream still stays; once it is answered the stream, the dead worker's load
    and its prefixes go. A dead worker whose stream is already gone loses its registration meanwhile; one
    that stopped beating less than consumer_idle_s ago keeps its (empty) stream."""
    caplog.set_level(logging.INFO, logger="streamer.worker")
    r = redis.Redis.from_url(redis_url)
    ghost = NAMES.worker_requests("ghost")
    ckpt = long_context_checkpoint(tmp_path / "ckpt")  # room for jobs that outlast the looks below
    async with running_worker(ckpt, redis_url, engine={"num_kv_blocks": 1100, "max_num_seqs": 1},
                              claim_idle_s=CLAIM_IDLE_S, consumer_idle_s=30.0) as worker, \
            AsyncClient(redis_url) as client:
        await client.submit("hi", id="busy", params=LONG)
        await wait_for(lambda: len(read_events(redis_url, "busy")) > 2, timeout=30)  # the seat is taken
        routed_to(r, "ghost", "for-ghost", redis_now_ms(r) - 60_000, LONG)  # its last beat a minute ago
        r.hset(NAMES.loads, "ghost", 3)
        r.sadd(NAMES.worker_prefixes("ghost"), "a-digest")
        # Looked at first (the oldest beat): a dead worker whose stream is gone (evicted, deleted by hand,
        # lost with a shard). Nothing to take from it; its registration goes, the others are still looked at.
        r.zadd(NAMES.worker_streams, {"vanished": redis_now_ms(r) - 120_000})
        r.xgroup_create(NAMES.worker_requests("recent"), NAMES.group, id="0", mkstream=True)
        r.zadd(NAMES.worker_streams, {"recent": redis_now_ms(r)})  # no heartbeat since: dead, but lately
        await wait_for(lambda: r.zscore(NAMES.worker_streams, "vanished") is None, timeout=10)
        await looks_pass()
        waiting = r.xinfo_groups(ghost)[0]
        assert (waiting["lag"], waiting["pending"]) == (1, 0) and not read_events(redis_url, "for-ghost")
        busy_ran = not has_ended(redis_url, "busy")
        await client.cancel("busy")
        await wait_for(lambda: len(read_events(redis_url, "for-ghost")) > 2, timeout=30)
        await looks_pass()
        running = r.xinfo_groups(ghost)[0]
        assert (running["lag"], running["pending"]) == (0, 1) and r.zscore(NAMES.worker_streams, "ghost") is not None
        assert r.xpending(ghost, NAMES.group)["consumers"] == [{"name": worker.cfg.consumer.encode(), "pending": 1}]
        ghost_ran = not has_ended(redis_url, "for-ghost")
        await client.cancel("for-ghost")
        await wait_for(lambda: r.zscore(NAMES.worker_streams, "ghost") is None, timeout=15)
    assert busy_ran and ghost_ran, "a job ended before the looks: the test saw no busy seat"
    assert check_complete(read_events(redis_url, "for-ghost"))["type"] == "done"
    assert dead_letters(redis_url) == []  # taken over once, acked under its own entry
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]  # no pass refused
    logged = [rec.getMessage() for rec in caplog.records]
    assert logged.count("took 1 job(s) routed to dead worker ghost") == 1
    assert "removing the request stream of worker ghost, gone for good" in logged
    assert r.exists(ghost, NAMES.worker_prefixes("ghost")) == 0 and r.hget(NAMES.loads, "ghost") is None
    assert r.zscore(NAMES.worker_streams, "recent") is not None and r.exists(NAMES.worker_requests("recent"))
    r.close()


@pytest.mark.anyio
async def test_a_job_a_live_worker_left_unread_past_claim_idle_is_taken(
        llama_ckpt: Path, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A worker that beats but has not read a job routed to it for longer than claim_idle_s (stalled)
    loses it to a worker with room, here one seat; its stream, alive, stays. A job a crashed consumer
    held in the shared stream is claimed by that one seat too."""
    caplog.set_level(logging.INFO, logger="streamer.worker")
    r = redis.Redis.from_url(redis_url)
    r.zadd(NAMES.heartbeats, {"slow": redis_now_ms(r) + 60_000, "bare": redis_now_ms(r) + 60_000})  # beating
    # Looked at first (the oldest beat): a live worker whose stream holds no group of ours (Redis lost it,
    # or it has only just registered). Nothing to take from it, and no reason to stop looking at the others.
    r.zadd(NAMES.worker_streams, {"bare": redis_now_ms(r) - 1000})
    r.xadd(NAMES.worker_requests("bare"), {"not": "a job"})
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    r.xadd(NAMES.requests, encode_job({"id": "orphan", "prompt": "hi", "params": SHORT}))
    r.xreadgroup(NAMES.group, "crashed", {NAMES.requests: ">"})  # read, never answered
    ten_s_ago = f"{redis_now_ms(r) - 10_000}-0"  # pushed 10 s ago, unread since
    routed_to(r, "slow", "for-slow", redis_now_ms(r), SHORT, entry_id=ten_s_ago)
    # One seat: a worker with room for exactly one job takes it.
    async with running_worker(llama_ckpt, redis_url, engine={"max_num_seqs": 1}, claim_idle_s=CLAIM_IDLE_S):
        await wait_for(lambda: has_ended(redis_url, "for-slow") and has_ended(redis_url, "orphan"), timeout=30)
    assert [check_complete(read_events(redis_url, rid))["type"] for rid in ("for-slow", "orphan")] == ["done"] * 2
    assert not [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]  # no pass refused
    assert "took 1 job(s) routed to stalled worker slow" in [rec.getMessage() for rec in caplog.records]
    assert r.zscore(NAMES.worker_streams, "slow") is not None and r.exists(NAMES.worker_requests("slow"))
    assert r.zscore(NAMES.worker_streams, "bare") is not None  # alive: its registration stays
    r.close()
