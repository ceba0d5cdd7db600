"""Gateway + real worker (engine on the tiny Llama) + real Redis, driven by a Python websockets client
and by the JS client under Node."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_worker_helpers import ROOT, offline_tokens, read_events, running_worker, tokens_of, wait_for
from test_gateway import (
    NAMES,
    StalledClient,
    assert_contiguous,
    collect,
    config,
    emit,
    node_command,
    recv,
    send,
)
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from clients.events import token_event
from streamer import SamplingParams
from workers.gateway.server import running_gateway
from workers.gateway.session import CLOSE_SLOW_CONSUMER

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_tokens": 900, "temperature": 0.0, "ignore_eos": True}  # seconds of work: time to cancel



def idle(worker: Any) -> bool:
    s = worker.engine.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0


@pytest.mark.anyio
async def test_concurrent_requests_on_one_socket_match_offline_engine(llama_ckpt: Path, redis_url: str) -> None:
    prompts = ["The quick brown fox", "Paged attention is", "The quick brown fox", "Redis streams"]
    expected = offline_tokens(llama_ckpt, prompts, SamplingParams(**GREEDY))
    ids = [f"q{i}" for i in range(len(prompts))]
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            connect(gw.ws_url) as ws:
        for rid, prompt in zip(ids, prompts, strict=True):
            await send(ws, {"type": "generate", "id": rid, "prompt": prompt, "params": GREEDY})
            await ws.send("{not json")  # bad frames in between touch nothing else
        await send(ws, {"type": "generate", "id": "bad", "prompt": "x", "params": {"max_tokens": -3}})
        strays: list[dict] = []
        got = await collect(ws, {*ids, "bad"}, timeout=60, strays=strays)
    assert [(f["code"], f["id"]) for f in strays] == [("bad_json", None)] * len(ids)
    for rid, want in zip(ids, expected, strict=True):
        assert_contiguous(got[rid])
        assert tokens_of(got[rid]) == want
        assert got[rid][-1]["finish_reason"] == "length"
        assert got[rid][-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    # Out-of-range params pass the gateway's shape check and are refused by the worker.
    assert [e["type"] for e in got["bad"]] == ["error"] and got["bad"][0]["code"] == "invalid_params"


@pytest.mark.anyio
async def test_cancel_frame_aborts_and_frees_kv_blocks(llama_ckpt: Path, redis_url: str) -> None:
    async with running_worker(llama_ckpt, redis_url) as worker, running_gateway(config(redis_url)) as gw, \
            connect(gw.ws_url) as ws:
        await send(ws, {"type": "generate", "id": "c1", "prompt": "count", "params": LONG})
        events = []
        while len(events) < 3:
            frame = await recv(ws, timeout=30)
            if frame["type"] == "token":
                events.append(frame)
        assert worker.engine.stats()["kv_blocks_used"] > 0
        await send(ws, {"type": "cancel", "id": "c1"})
        events += (await collect(ws, {"c1"}, timeout=30))["c1"]
        assert_contiguous(events)
        assert events[-1]["finish_reason"] == "abort"
        assert len(tokens_of(events)) < LONG["max_tokens"]
        await wait_for(lambda: idle(worker), timeout=10)


@pytest.mark.anyio
async def test_resume_after_disconnect_continues_without_gap_or_duplicate(llama_ckpt: Path,
                                                                          redis_url: str) -> None:
    params = {**GREEDY, "max_tokens": 200}
    (expected,) = offline_tokens(llama_ckpt, ["Once upon a time"], SamplingParams(**params))
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw:
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": "r1", "prompt": "Once upon a time", "params": params})
            first: list[dict] = []
            while len(first) < 3:
                frame = await recv(ws, timeout=30)
                if frame["type"] == "token":
                    first.append(frame)
        # The socket is gone; generation goes on (grace period) and the browser comes back.
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "resume", "id": "r1", "after_seq": first[-1]["seq"]})
            rest = (await collect(ws, {"r1"}, timeout=60))["r1"]
    events = first + rest
    assert_contiguous(events)
    assert tokens_of(events) == expected
    assert events[-1]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_closed_socket_cancels_in_the_worker_after_grace(llama_ckpt: Path, redis_url: str) -> None:
    async with running_worker(llama_ckpt, redis_url) as worker, \
            running_gateway(config(redis_url, cancel_grace_s=0.3)) as gw:
        async with connect(gw.ws_url) as ws:
            await send(ws, {"type": "generate", "id": "g1", "prompt": "abandoned", "params": LONG})
            while (await recv(ws, timeout=30))["type"] != "token":
                pass
        # The abort frees the blocks first; its `done` event reaches Redis a moment later.
        await wait_for(lambda: idle(worker) and read_events(redis_url, "g1")[-1]["type"] == "done", timeout=10)
    events = read_events(redis_url, "g1")
    assert events[-1]["finish_reason"] == "abort"
    assert len(tokens_of(events)) < LONG["max_tokens"]


@pytest.mark.anyio
async def test_auth_refused_and_slow_reader_closed_while_fast_one_finishes(llama_ckpt: Path,
                                                                           redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    big = "y" * 16384
    await emit(r, "slow", [token_event("slow", s, 0, [1], big) for s in range(600)], publish=False)
    cfg = config(redis_url, api_keys=("secret",), send_queue_bytes=256 * 1024, close_timeout_s=1)
    async with running_worker(llama_ckpt, redis_url), running_gateway(cfg) as gw:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(gw.ws_url):
                pass
        assert refused.value.response.status_code == 401
        stalled = await asyncio.to_thread(StalledClient, gw.ws_url + "?token=secret")
        stalled.send({"type": "resume", "id": "slow"})
        async with connect(gw.ws_url, additional_headers={"Authorization": "Bearer secret"}) as fast:
            await send(fast, {"type": "generate", "id": "fast", "prompt": "hi", "params": GREEDY})
            got = (await collect(fast, {"fast"}, timeout=60))["fast"]
        assert_contiguous(got)
        assert got[-1]["finish_reason"] == "length", got[-1]
        close = await asyncio.to_thread(stalled.read_until_closed)
        assert close is not None and close.code == CLOSE_SLOW_CONSUMER
    assert await r.xlen(NAMES.requests) == 0 and not await r.exists(NAMES.job("slow"))
    await r.aclose()


NODE_SCRIPT = """
import { StreamerClient } from %(client)s;
const client = new StreamerClient(process.argv[2]);
const out = (o) => console.log(JSON.stringify(o));
const whole = await client.generate({ id: "node1", prompt: "Hello from Node", params: %(greedy)s }).text();
out({ text: whole.text, reason: whole.event.finish_reason, usage: whole.event.usage });
const long = client.generate({ prompt: "count", params: %(long)s });
let seen = 0;
for await (const event of long) {
  if (event.type === "token" && ++seen === 2) long.cancel();
  if (event.type === "done") out({ cancelled: event.finish_reason, seen });
}
for await (const event of client.generate({ id: "node-break", prompt: "count", params: %(long)s })) {
  if (event.type === "token") break;  // leaving early cancels
}
try {
  for await (const event of client.generate({ prompt: "x", params: { max_tokens: -1 } })) out(event);
} catch (err) {
  out({ error: err.name, code: err.code });
}
client.close();
"""


@pytest.mark.anyio
async def test_js_client_under_node(llama_ckpt: Path, redis_url: str, tmp_path: Path) -> None:
    script = tmp_path / "client_test.mjs"
    client_url = (ROOT / "clients" / "web" / "streamer-client.js").as_uri()
    script.write_text(NODE_SCRIPT % {"client": json.dumps(client_url), "greedy": json.dumps(GREEDY),
                                     "long": json.dumps(LONG)})
    async with running_worker(llama_ckpt, redis_url) as worker, running_gateway(config(redis_url)) as gw:
        proc = await asyncio.create_subprocess_exec(*node_command(), str(script), gw.ws_url,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
        assert proc.returncode == 0, err.decode()
        lines = [json.loads(line) for line in out.decode().splitlines()]
        await wait_for(lambda: idle(worker) and read_events(redis_url, "node-break")[-1]["type"] == "done",
                       timeout=10)
    stored = read_events(redis_url, "node1")
    assert lines[0] == {"text": "".join(e["text"] for e in stored), "reason": "length",
                        "usage": stored[-1]["usage"]}
    assert lines[0]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert lines[1] == {"cancelled": "abort", "seen": lines[1]["seen"]} and lines[1]["seen"] >= 2
    assert lines[2] == {"error": "StreamerError", "code": "invalid_params"}
    assert read_events(redis_url, "node-break")[-1]["finish_reason"] == "abort"
