"""Bad jobs get an error event or, with no id to answer under, a dead letter, and never stop the worker
serving the others."""

import json

import msgpack
import pytest
import redis
from redis_worker_helpers import check_complete, dead_letters, read_events, running_worker, tokens_of, wait_for

from clients.protocol import Names
from clients.redis_client import AsyncClient

GOOD = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def job(request_id, **fields):
    return {"json": json.dumps({"v": 1, "id": request_id, **fields})}


# (entry fields, request id that must get an error event or None, expected code)
BAD = [
    ({"json": b"\xff\xfe\x00 not utf-8"}, None, "bad_encoding"),
    ({"msgpack": b"\xc1\xc1"}, None, "bad_encoding"),
    ({"msgpack": b"\x91" * 50_000 + b"\xc0"}, None, "bad_encoding"),  # deeply nested
    ({"msgpack": b"\xdf\xff\xff\xff\xff" + b"\x00" * 64}, None, "bad_encoding"),  # claims 4G entries
    ({"msgpack": msgpack.packb({"v": 1, "id": "huge", "prompt": "x" * (2 << 20)})}, None, "too_large"),
    ({"text": "hello"}, None, "bad_encoding"),
    (job("wrong-type", prompt=["not", "a", "string"]), "wrong-type", "invalid_request"),
    (job("unknown-field", prompt="hi", temperature=0.5), "unknown-field", "invalid_request"),
    ({"json": json.dumps({"v": 9, "id": "bad-version", "prompt": "hi"})}, "bad-version", "unsupported_version"),
    (job("range", prompt="hi", params={"temperature": -1.0}), "range", "invalid_params"),
    (job("unknown-param", prompt="hi", params={"nucleus_mass": 0.9}), "unknown-param", "invalid_params"),
    (job("type-param", prompt="hi", params={"max_tokens": "many"}), "type-param", "invalid_params"),
    (job("too-long", prompt_token_ids=[7] * 5000, params=GOOD), "too-long", "invalid_request"),
    (job("bad-token", prompt_token_ids=[10**9], params=GOOD), "bad-token", "invalid_request"),
    (job("bad-chat", messages=[{"role": "user", "content": 3}]), "bad-chat", "invalid_request"),
    # Used to crash the engine step (and the worker) once min_tokens masked the id in the logits.
    (job("poison-stop-id", prompt="hi", params={"min_tokens": 2, "stop_token_ids": [100000]}), "poison-stop-id",
     "invalid_request"),
]

UNANSWERABLE = [bad for bad in BAD if bad[1] is None]  # no id to answer under: only a dead letter


@pytest.mark.anyio
async def test_bad_jobs_are_answered_and_others_complete(llama_ckpt, redis_url):
    r = redis.Redis.from_url(redis_url)
    names = Names()
    async with running_worker(llama_ckpt, redis_url) as worker, AsyncClient(redis_url) as client:
        good_before = await client.submit("good before", params=GOOD)
        for fields, _, _ in BAD:
            r.xadd(names.requests, fields)
        dup_first = await client.submit("the first owner", id="dup", params=GOOD)
        await client.submit("an impostor", id="dup", params={**GOOD, "max_tokens": 2})
        good_after = await client.submit("good after", params=GOOD)
        results = {rid: await client.generate("again", params=GOOD, timeout=30) for rid in range(2)}

        await wait_for(lambda: len(dead_letters(redis_url)) >= len(UNANSWERABLE) + 1, timeout=30)
        await wait_for(lambda: r.xlen(names.requests) == 0, timeout=30)  # every entry answered and removed
        assert worker.engine.stats()["num_requests"] == 0

    for rid in (good_before, good_after, dup_first):
        events = read_events(redis_url, rid)
        assert check_complete(events)["type"] == "done" and len(tokens_of(events)) == 6, rid
    assert all(len(g.token_ids[0]) == 6 for g in results.values())

    for _, rid, code in BAD:
        if rid is not None:
            events = read_events(redis_url, rid)
            assert [(e["type"], e["code"]) for e in events] == [("error", code)], rid
            assert events[0]["message"]
    letters = dead_letters(redis_url)
    reasons = sorted(d["reason"].decode() for d in letters)
    # A job refused in its own stream got its answer: the client's mistake is no operator's dead letter.
    assert reasons == sorted([code for _, _, code in UNANSWERABLE] + ["duplicate_id"])
    assert not {d.get("id") for d in letters} & {rid.encode() for _, rid, _ in BAD if rid is not None}
    duplicate = next(d for d in letters if d["reason"] == b"duplicate_id")
    assert duplicate["id"] == b"dup" and b"impostor" in duplicate["payload_json"]
    # The undecodable payload is kept byte for byte for whoever inspects the dead letters.
    assert any(d.get("payload_json") == b"\xff\xfe\x00 not utf-8" for d in letters)
    huge = next(d for d in letters if d["reason"] == b"too_large")
    assert len(huge["payload_msgpack"]) == 4096 and int(huge["payload_bytes"]) > 2 << 20  # --dead-payload-bytes
    r.close()


@pytest.mark.anyio
async def test_poison_job_dead_lettered_after_too_many_deliveries(llama_ckpt, redis_url):
    """A job whose workers keep dying is handed out again and again; past the limit it is retired."""
    r = redis.Redis.from_url(redis_url)
    names = Names()
    r.xgroup_create(names.requests, names.group, id="0", mkstream=True)
    entry = r.xadd(names.requests, job("poison", prompt="hi", params=GOOD))
    r.xreadgroup(names.group, "crashed-1", {names.requests: ">"})
    for ghost in ("crashed-2", "crashed-3"):  # two more deliveries to workers that died
        r.xclaim(names.requests, names.group, ghost, 0, [entry])
    async with running_worker(llama_ckpt, redis_url, claim_idle_s=0.3, max_deliveries=3):
        await wait_for(lambda: r.xlen(names.requests) == 0, timeout=20)
    events = read_events(redis_url, "poison")
    assert [(e["type"], e["code"]) for e in events] == [("error", "too_many_deliveries")]
    assert [d["reason"] for d in dead_letters(redis_url)] == [b"too_many_deliveries"]
    r.close()


@pytest.mark.anyio
async def test_foreign_entries_in_an_event_stream(llama_ckpt, redis_url):
    """Someone wrote into llm:events:{id} by hand: the job is dead-lettered, the worker goes on."""
    r = redis.Redis.from_url(redis_url)
    r.xadd(Names().events("squatted"), {"json": b"not an event"}, id="0-7")
    r.set(Names().events("wrong-type"), "a string where a stream belongs")
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        await client.submit("hi", id="squatted", params=GOOD)
        await client.submit("hi", id="wrong-type", params=GOOD)
        ok = await client.generate("still serving", params=GOOD, timeout=30)
        await wait_for(lambda: len(dead_letters(redis_url)) == 2, timeout=10)
    assert len(ok.token_ids[0]) == 6
    assert [d["reason"] for d in dead_letters(redis_url)] == [b"damaged_events"] * 2
    assert r.xlen(Names().events("squatted")) == 1  # left as it was
    r.close()
