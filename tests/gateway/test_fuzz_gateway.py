"""Fuzzing the gateway's `/ws` (issue 13): generated frames through one socket to a gateway in front of a
real worker (tiny Llama) and a real Redis. The contract, for every frame:

- it is answered: an `error` frame, or `accepted` and then the request's events up to `done`/`error`;
  never silence;
- an error names the frame's request id whenever the id can be read (the frame's own valid `id`),
  and is one of the documented codes, never `internal`;
- the socket stays open (no 1011, no other close): the next frame is served on it.

One gateway and one worker for the module, one socket per test; ids are fresh per example."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fuzz_jobs import SCALARS, damage, jobs, nested
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis_worker_helpers import running_worker
from test_gateway import config
from websockets.sync.client import ClientConnection, connect

from clients.protocol import readable_id
from workers.gateway.server import running_gateway
from workers.redis_server import RedisServer

GATEWAY_CODES = {"bad_json", "bad_frame", "too_large", "unknown_type", "invalid_request", "invalid_params",
                 "unsupported_version", "bad_encoding", "duplicate_id", "too_many_requests", "unknown_request",
                 "already_finished"}
WORKER_CODES = {"invalid_request", "invalid_params", "expired"}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_FRAME = 64 * 1024


@pytest.fixture(scope="module")
def gateway(llama_ckpt: Path) -> Iterator[str]:
    """Worker and gateway serving in a thread of their own (one event loop) for the whole module."""
    with RedisServer() as server:
        started, stop, box = threading.Event(), threading.Event(), {}

        def serve() -> None:
            async def main() -> None:
                async with running_worker(llama_ckpt, server.url, {"max_num_seqs": 16}), \
                        running_gateway(config(server.url, max_frame_bytes=MAX_FRAME)) as gw:
                    box["url"] = gw.ws_url
                    started.set()
                    await anyio.to_thread.run_sync(stop.wait)

            try:
                anyio.run(main)
            except BaseException as e:
                box["error"] = e
                started.set()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        assert started.wait(60) and "error" not in box, box.get("error")
        yield box["url"]
        stop.set()
        thread.join(30)
        assert "error" not in box, box.get("error")


@pytest.fixture(scope="module")
def ws(gateway: str) -> Iterator[ClientConnection]:
    with connect(gateway, max_size=None, close_timeout=2) as conn:
        yield conn


def answer(ws: ClientConnection, frame: str | bytes, rid: str | None) -> list[dict[str, Any]]:
    """Send one frame and read what it gets: one error frame, or `accepted` then the request's events
    to the end. Fails on silence (no frame within the timeout) or a closed socket."""
    ws.send(frame)
    got = [json.loads(ws.recv(timeout=30))]
    if got[0]["type"] == "accepted":
        accepted = got[0]["id"]
        assert rid is None or accepted == rid, got
        while got[-1]["type"] not in ("done", "error"):
            got.append(json.loads(ws.recv(timeout=30)))
            assert got[-1]["id"] == accepted, got
    return got


def check(got: list[dict[str, Any]], rid: str | None) -> None:
    first, last = got[0], got[-1]
    event(f"{first['type']}: {last['type']} {last.get('code', '')}")
    if first["type"] == "error":
        assert len(got) == 1 and first["source"] == "gateway", got
        assert first["code"] in GATEWAY_CODES, first
        assert first["id"] == rid, (first, rid)  # the readable id, or none
    else:
        assert [f["seq"] for f in got[1:]] == list(range(len(got) - 1)), got
        assert last["type"] == "done" or last["code"] in WORKER_CODES, last


def text_of(frame: dict[str, Any], how: str) -> str:
    return json.dumps(frame, ensure_ascii=how == "escaped")


@FUZZ
@given(job=jobs(), kind=st.sampled_from(["generate", "generate", "generate", None, "resume", "cancel"]),
       how=st.sampled_from(["escaped", "raw"]), id_kind=st.sampled_from(["fresh", "fresh", "fresh", "none", "bad"]))
def test_every_frame_is_answered_with_its_id(ws: ClientConnection, job: dict[str, Any], kind: str | None, how: str,
                                             id_kind: str) -> None:
    frame = dict(job)
    if kind is not None:
        frame["type"] = kind
    rid = None
    if id_kind == "fresh":
        rid = frame["id"] = uuid.uuid4().hex
    elif id_kind == "bad":
        frame["id"] = "not an id!"
    if kind in ("resume", "cancel"):
        frame = {"type": kind, **({"id": frame["id"]} if "id" in frame else {}), **(
            {"after_seq": job.get("priority")} if kind == "resume" else {})}
    try:
        text = text_of(frame, how)
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate cannot travel raw in a text frame: send it escaped
        text = text_of(frame, "escaped")
    if len(text.encode()) > MAX_FRAME:
        return
    check(answer(ws, text, rid), rid)


@FUZZ
@given(job=jobs(), data=st.data())
def test_damaged_frames_are_answered_and_the_socket_goes_on(ws: ClientConnection, job: dict[str, Any],
                                                           data: st.DataObject) -> None:
    rid = uuid.uuid4().hex
    frame = {"type": "generate", "id": rid, **{k: v for k, v in job.items() if k != "v"}}
    raw = data.draw(damage(text_of(frame, "escaped").encode()))
    kind = data.draw(st.sampled_from(["text", "text", "binary", "deep", "scalar"]))
    if kind == "binary":
        got = answer(ws, raw, None)
        assert (got[0]["code"], got[0]["id"]) == ("bad_frame", None)
        return
    if kind == "deep":  # nested far past what the JSON decoder can take, the id at the top level
        text = json.dumps({"type": "generate", "id": rid, "prompt": "x"})[:-1] + ', "params": ' + (
            "[" * 30_000 + "]" * 30_000) + "}"
    elif kind == "scalar":
        text = json.dumps(data.draw(SCALARS))
    else:
        text = raw.decode("utf-8", "replace")
    # Whichever id the frame still carries readably is the one an error must name.
    expect = readable_id(text)
    got = answer(ws, text, expect)
    if got[0]["type"] == "error":
        event(f"error {got[0]['code']}, id {'readable' if expect else 'none'}")
        assert got[0]["code"] in GATEWAY_CODES, got
        assert got[0]["id"] == expect, (text[:200], got)
    else:
        check(got, None)


def test_the_socket_still_serves_after_the_fuzzing(ws: ClientConnection) -> None:
    rid = uuid.uuid4().hex
    got = answer(ws, json.dumps({"type": "generate", "id": rid, "prompt": "still there?", "params": {
        "max_tokens": 2, "ignore_eos": True}}), rid)
    accepted = {k: v for k, v in got[0].items() if k != "workers"}  # the live-worker count is timing
    assert accepted == {"type": "accepted", "id": rid} and got[-1]["type"] == "done" and len(got) == 4
    assert nested(3) == {"k": [{"k": 1}]}  # the helper the strategies nest with
