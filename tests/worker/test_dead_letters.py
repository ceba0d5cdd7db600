"""Issue 13, bounded Redis: dead letters keep a bounded payload prefix and are trimmed by age and
count, whatever clients send; `streamer dead` (the real CLI, against a real redis-server, with a real
worker) lists, shows, requeues and purges them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import redis
from redis_worker_helpers import check_complete, dead_letters, has_ended, read_events, running_worker, wait_for

from clients.protocol import Names

ROOT = Path(__file__).resolve().parents[2]
NAMES = Names()
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def streamer(*args: str, url: str) -> subprocess.CompletedProcess:
    """The real `streamer` CLI in a child process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    env.update(STREAMER_REDIS=url, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=env)


async def cli(*args: str, url: str) -> subprocess.CompletedProcess:
    return await anyio.to_thread.run_sync(lambda: streamer(*args, url=url))


def _job(rid: str, **fields: object) -> dict[str, str]:
    return {"json": json.dumps({"v": 1, "id": rid, **fields})}


@pytest.mark.anyio
async def test_dead_letters_are_bounded_in_bytes_age_and_count(llama_ckpt: Path, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    for ms in range(1, 301):  # dead letters from long ago (their ids carry their time)
        r.xadd(NAMES.dead, {"reason": "internal", "message": "old"}, id=f"{ms}-0")
    async with running_worker(llama_ckpt, redis_url, dead_payload_bytes=1000, dead_max_age_s=3600,
                              dead_max_len=50):
        r.xadd(NAMES.requests, {"json": b"{" + b"x" * 200_000})  # 200 KB of bad JSON
        r.xadd(NAMES.requests, {f"field-{i:03d}-" + "n" * 200: "v" * 100 for i in range(100)})  # 100 fields
        r.set(NAMES.job("taken"), "0-1")  # another entry owns the id: the job cannot be served
        r.xadd(NAMES.requests, _job("taken", prompt="hi", params=GREEDY))
        await wait_for(lambda: r.xlen(NAMES.requests) == 0, timeout=30)
        letters = dead_letters(redis_url)
        assert len(letters) <= 100, len(letters)  # trimmed by age (whole nodes: `~`)
        new = [d for d in letters if d["message"] != b"old"]
        assert len(new) == 3
        big = next(d for d in new if "payload_json" in d and "id" not in d)
        many = next(d for d in new if "payload_json" not in d)
        taken = next(d for d in new if d.get("id") == b"taken")
        assert big["reason"] == b"bad_encoding" and len(big["payload_json"]) == 1000
        assert int(big["payload_bytes"]) == 200_001
        payload_fields = [k for k in many if k.startswith("payload_") and k != "payload_bytes"]
        assert len(payload_fields) == 4 and all(len(k) == len("payload_") + 64 for k in payload_fields)
        assert all(len(many[k]) == 100 for k in payload_fields) and int(many["payload_bytes"]) == 100 * 100
        assert many["reason"] == b"bad_encoding" and len(many["message"]) == 1024
        assert taken["reason"] == b"duplicate_id" and "payload_bytes" not in taken
        assert json.loads(taken["payload_json"])["id"] == "taken"  # kept whole
        # The count cap: far more bad jobs than dead_max_len leave about dead_max_len letters.
        for i in range(300):
            r.xadd(NAMES.requests, {"json": f"not json {i}"})
        await wait_for(lambda: r.xlen(NAMES.requests) == 0, timeout=60)
        assert 50 <= r.xlen(NAMES.dead) <= 150, r.xlen(NAMES.dead)  # `~`: within a node of the cap
    r.close()


@pytest.mark.anyio
async def test_streamer_dead_lists_shows_requeues_and_purges(llama_ckpt: Path, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.xadd(NAMES.dead, {"reason": "internal", "message": "old"}, id="1000-0")  # from 1970
    async with running_worker(llama_ckpt, redis_url, dead_payload_bytes=1000) as worker:
        ids = {}
        for rid, params in (("cut", {**GREEDY, "stop": ["s" * 2000]}), ("whole", GREEDY)):
            r.set(NAMES.job(rid), "0-1")  # another entry owns the id: a duplicate, kept as a dead letter
            r.xadd(NAMES.requests, _job(rid, prompt="hi", params=params))
            await wait_for(lambda: r.xlen(NAMES.dead) == len(ids) + 2, timeout=30)
            (dead_id, _), = r.xrevrange(NAMES.dead, count=1)
            ids[rid] = dead_id.decode()

        listing = await cli("dead", "list", url=redis_url)
        assert listing.returncode == 0, listing.stderr
        lines = listing.stdout.splitlines()
        assert lines[0].split() == ["ID", "TIME", "(UTC)", "REASON", "REQUEST", "WORKER", "PAYLOAD"]
        assert lines[1].startswith(ids["whole"]) and "duplicate_id" in lines[1]  # newest first
        assert worker.cfg.consumer in lines[1] and "(cut)" in lines[2] and "1970-01-01" in lines[3]
        assert lines[-1].startswith("3 newest of 3 dead letter(s) in llm:dead")
        assert (await cli("dead", "list", "--count", "1", url=redis_url)).stdout.count("duplicate_id") == 1

        shown = await cli("dead", "show", ids["whole"], url=redis_url)
        assert shown.returncode == 0, shown.stderr
        whole = json.loads(shown.stdout)
        assert whole["dead_letter"] == ids["whole"] and whole["fields"]["reason"] == "duplicate_id"
        assert whole["payload"] == {"v": 1, "id": "whole", "prompt": "hi", "params": GREEDY}

        cut = await cli("dead", "requeue", ids["cut"], url=redis_url)
        assert cut.returncode == 2 and "kept only 1000 of its" in cut.stderr and "cannot be requeued" in cut.stderr
        busy = await cli("dead", "requeue", ids["whole"], url=redis_url)
        assert busy.returncode == 2 and "request id 'whole' is still in use" in busy.stderr, busy.stderr
        for bad in ("0-1", "bogus"):
            missing = await cli("dead", "show", bad, url=redis_url)
            assert missing.returncode == 2 and "dead letter" in missing.stderr
        assert (await cli("dead", "purge", url=redis_url)).returncode == 2  # purge what? refused

        # A whole payload whose id is free again: pushed back as it was, served, gone from the dead.
        good = {"v": 1, "id": "retry-me", "prompt": "hi", "params": GREEDY}
        dead_id = r.xadd(NAMES.dead, {"reason": "internal", "message": "worker error: boom", "id": "retry-me",
                                      "payload_json": json.dumps(good)}).decode()
        requeued = await cli("dead", "requeue", dead_id, url=redis_url)
        assert requeued.returncode == 0 and f"requeued dead letter {dead_id} (request retry-me)" in requeued.stdout
        await wait_for(lambda: has_ended(redis_url, "retry-me"), timeout=30)
        assert check_complete(read_events(redis_url, "retry-me"))["type"] == "done"
        assert not r.xrange(NAMES.dead, min=dead_id, max=dead_id)

        purged = await cli("dead", "purge", "1d", url=redis_url)
        assert purged.returncode == 0 and "removed 1 dead letter(s) older than 1d" in purged.stdout
        assert r.xlen(NAMES.dead) == 2
        purged = await cli("dead", "purge", "all", url=redis_url)
        assert purged.returncode == 0 and "removed 2 dead letter(s)" in purged.stdout
        assert not r.exists(NAMES.dead)
        assert "no dead letters" in (await cli("dead", "list", url=redis_url)).stdout
    r.close()
