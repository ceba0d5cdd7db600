"""Fuzzing the Redis path (issue 13): raw fields XADDed straight onto the requests stream of a running
worker (real engine on the tiny Llama, real Redis). The contract, for every input:

- a payload whose request id can be read gets exactly one final event in `events:{id}` (`done`, or an
  `error` with a documented code): never silence, never `internal`;
- a payload whose id cannot be read is dead-lettered (its entry named), and acknowledged;
- the worker never crashes: it serves a good job after all of them.

One worker for the module; ids are fresh per example."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
import redis
from fuzz_jobs import damage, jobs
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis_worker_helpers import check_complete, read_events, running_worker

from clients.errors import ProtocolError
from clients.protocol import Names, decode_job
from workers.redis_server import RedisServer
from workers.worker.answers import CLIENT_FAULTS

NAMES = Names()
# What the worker may answer (docs/protocol.md): never `internal`, which would mean a bug.
CODES = {"bad_encoding", "too_large", "invalid_request", "unsupported_version", "invalid_params", "expired"}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def worker(llama_ckpt: Path) -> Iterator[dict[str, Any]]:
    """A worker serving in a thread of its own (its own event loop) for the whole module."""
    with RedisServer() as server:
        started, stop, box = threading.Event(), threading.Event(), {}

        def serve() -> None:
            async def main() -> None:
                async with running_worker(llama_ckpt, server.url, {"max_num_seqs": 16}) as w:
                    box["worker"] = w
                    started.set()
                    await anyio.to_thread.run_sync(stop.wait)

            try:
                anyio.run(main)
            except BaseException as e:  # reported by the tests, not lost in the thread
                box["error"] = e
                started.set()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        assert started.wait(60) and "error" not in box, box.get("error")
        client = redis.Redis.from_url(server.url)
        box.update(url=server.url, redis=client)
        yield box
        stop.set()
        thread.join(30)
        client.close()
        assert "error" not in box, box.get("error")


def encode(job: dict[str, Any], encoding: str, how: str) -> bytes:
    """The job in its encoding; text that is not valid Unicode goes out as JSON escapes or as the bytes
    a careless encoder would write (surrogates as UTF-8: not UTF-8 at all)."""
    if encoding == "msgpack":
        return msgpack.packb(job, use_bin_type=True, unicode_errors="surrogatepass")
    if how == "escaped":
        return json.dumps(job).encode()
    return json.dumps(job, ensure_ascii=False).encode("utf-8", "surrogatepass")


def outcome(box: dict[str, Any], rid: str, entry: bytes, timeout: float = 30) -> tuple[list[dict], list[dict]]:
    """(events of `rid` once one is final, dead letters of `entry`), as soon as either says the job was
    answered; fails when nothing comes (silence)."""
    r: redis.Redis = box["redis"]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert "error" not in box, box["error"]  # the worker is still running
        events = read_events(box["url"], rid)
        letters = [f for _, f in r.xrange(NAMES.dead) if f.get(b"entry") == entry]
        if events and events[-1]["type"] in ("done", "error"):
            return events, letters
        if letters and not r.exists(NAMES.job(rid)):  # dead-lettered without an answer (no readable id)
            return events, letters
        time.sleep(0.02)
    pytest.fail(f"no answer for {rid} (entry {entry!r}) within {timeout}s: silence")


def check_answered(events: list[dict], letters: list[dict]) -> None:
    event(f"{events[-1]['type']} {events[-1].get('code', '')}" if events else "dead letter only")
    if events:
        final = check_complete(events)
        if final["type"] == "error":
            assert final["code"] in CODES, final
            # The client's own mistakes are answered, not kept; anything else is kept for the operator.
            assert bool(letters) == (final["code"] not in CLIENT_FAULTS | {"expired"}), (final, letters)


@FUZZ
@given(job=jobs(), encoding=st.sampled_from(["json", "msgpack"]), how=st.sampled_from(["escaped", "raw"]))
def test_jobs_with_a_readable_id_are_always_answered(worker: dict[str, Any], job: dict[str, Any], encoding: str,
                                                      how: str) -> None:
    rid = uuid.uuid4().hex
    job = {**job, "id": rid}
    try:
        payload = encode(job, encoding, how)
    except (OverflowError, TypeError, ValueError):  # msgpack has no integers past 64 bits
        payload = encode(job, "json", how)
        encoding = "json"
    entry = worker["redis"].xadd(NAMES.requests, {encoding: payload})
    events, letters = outcome(worker, rid, entry)
    assert events, f"the id {rid} was readable, yet only a dead letter came: {letters}"
    check_answered(events, letters)


@FUZZ
@given(job=jobs(), encoding=st.sampled_from(["json", "msgpack"]), data=st.data())
def test_damaged_payloads_are_answered_or_dead_lettered(worker: dict[str, Any], job: dict[str, Any], encoding: str,
                                                         data: st.DataObject) -> None:
    rid = uuid.uuid4().hex
    job = {**job, "id": rid}
    try:
        payload = encode(job, encoding, "escaped")
    except (OverflowError, TypeError, ValueError):
        payload, encoding = encode(job, "json", "escaped"), "json"
    fields = data.draw(st.sampled_from([{encoding: data.draw(damage(payload))},
                                        {encoding: payload, "other": b"x"},  # two fields
                                        {"text": payload}]))  # no known field
    entry = worker["redis"].xadd(NAMES.requests, fields)
    events, letters = outcome(worker, readable_id_of(fields, rid), entry)
    assert events or letters
    check_answered(events, letters)


def readable_id_of(fields: dict[str, Any], fallback: str) -> str:
    """The id the worker answers under: damage can leave a valid job whose id is another valid id."""
    try:
        return decode_job(fields).id
    except ProtocolError as e:
        return e.request_id or fallback


def test_the_worker_still_serves_after_the_fuzzing(worker: dict[str, Any]) -> None:
    rid = uuid.uuid4().hex
    entry = worker["redis"].xadd(NAMES.requests, {"json": json.dumps(
        {"v": 1, "id": rid, "prompt": "still there?", "params": {"max_tokens": 3, "ignore_eos": True}})})
    events, _ = outcome(worker, rid, entry)
    assert check_complete(events)["type"] == "done" and len(events) == 4
    # Every fuzzed entry was answered and removed from the requests stream.
    deadline = time.monotonic() + 30
    while worker["redis"].xlen(NAMES.requests) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker["redis"].xlen(NAMES.requests) == 0
    assert worker["worker"].state.engine_error is None
