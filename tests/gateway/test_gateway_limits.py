"""What the gateway refuses before anything reaches Redis, and how (issue 13): every bad frame gets an
error frame carrying its request id whenever the id can be read, the socket stays open (no 1011), and
nothing a worker could only dead-letter without an answer is pushed. Also its liveness and readiness
endpoints, and its refusal to serve beyond loopback without an API key.

The worker's side is played by the test, as in test_gateway.py (events written into Redis as the wire
contract says); the fuzz tests in test_fuzz_gateway.py run a real worker."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import NAMES, config, done, emit, http_get, recv, send, tokens, wait_jobs, without_workers
from websockets.asyncio.client import ClientConnection, connect

from workers.errors import UserError
from workers.gateway.config import GatewayConfig, is_loopback
from workers.gateway.server import running_gateway
from workers.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


async def reply_to(ws: ClientConnection, frame: str | dict[str, Any]) -> dict[str, Any]:
    await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
    return await recv(ws, timeout=10)


async def beat(r: aioredis.Redis, name: str, **stats: Any) -> None:
    """A worker's heartbeat as workers write it: its stats hash and its name in the heartbeat set."""
    await r.hset(NAMES.worker(name), mapping={"model": "tiny", **{k: str(v) for k, v in stats.items()}})
    await r.pexpire(NAMES.worker(name), 10_000)
    seconds, micros = await r.time()
    await r.zadd(NAMES.heartbeats, {name: seconds * 1000 + micros // 1000})


DEEP = "[" * 100_000 + "]" * 100_000

# (frame text, code, id the error must carry)
REFUSED = [
    # Nested 7 levels: used to be accepted, then dead-lettered by the worker without an id.
    (json.dumps({"type": "generate", "id": "n7", "prompt": "x", "params": {"a": [[[[1]]]]}}), "bad_encoding",
     "n7"),
    # Too deep for the JSON decoder itself (used to close the socket with 1011).
    ('{"type":"generate","id":"deep","prompt":"x","params":{"a":' + DEEP + "}}", "bad_json", "deep"),
    (DEEP, "bad_json", None),
    # A lone surrogate (used to close the socket with 1011), in a value and in a key.
    ('{"type":"generate","id":"sur","prompt":"a\\ud800b"}', "invalid_request", "sur"),
    ('{"type":"generate","id":"sur2","prompt":"x","params":{"stop":["\\udfff"]}}', "invalid_request", "sur2"),
    ('{"type":"generate","id":"sur3","prompt":"x","\\ud800":1}', "invalid_request", "sur3"),
    ('{"type":"\\ud800"}', "unknown_type", None),
    # NaN and Infinity are not JSON: nobody else could read such a job.
    ('{"type":"generate","id":"nan","prompt":"x","params":{"temperature":NaN}}', "bad_json", "nan"),
    ('{"type":"generate","id":"inf","prompt":"x","params":{"temperature":1e999}}', "invalid_params", "inf"),
    # Broken inside a nested value: the top level still names the request.
    ('{"type":"generate","id":"broken","prompt":"x","params":{"max_tokens":1,}}', "bad_json", "broken"),
    # Over --max-frame-bytes (4096 here): refused with the id too.
    (json.dumps({"type": "generate", "id": "big", "prompt": "x" * 5000}), "too_large", "big"),
    # Over --max-prompt-tokens (8 here).
    (json.dumps({"type": "generate", "id": "long", "prompt_token_ids": list(range(9))}), "invalid_request",
     "long"),
    # after_seq past any seq (used to close the socket with 1011: Redis refused the stream id).
    (json.dumps({"type": "resume", "id": "r1", "after_seq": 2**64}), "invalid_request", "r1"),
    (json.dumps({"type": "resume", "id": "r1", "after_seq": -2}), "invalid_request", "r1"),
    # An invalid id is not echoed back.
    (json.dumps({"type": "cancel", "id": "no spaces allowed"}), "invalid_request", None),
    # Sampling parameters the engine refuses (the page's settings): used to be pushed, then refused by
    # the worker and kept in the operator's dead letters.
    (json.dumps({"type": "generate", "id": "cold", "prompt": "x", "params": {"temperature": -5}}), "invalid_params",
     "cold"),
    (json.dumps({"type": "generate", "id": "nucleus", "prompt": "x", "params": {"nucleus": 0.9}}),
     "invalid_params", "nucleus"),
]


@pytest.mark.anyio
async def test_bad_frames_are_refused_with_their_id_and_the_socket_goes_on(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    cfg = config(redis_url, max_frame_bytes=4096 * 64, max_prompt_tokens=8)
    async with running_gateway(cfg) as gw, connect(gw.ws_url, max_size=None) as ws:
        for frame, code, rid in REFUSED:
            if code == "too_large":
                frame = frame.replace("x" * 5000, "x" * (cfg.max_frame_bytes + 1))
            reply = await reply_to(ws, frame)
            assert (reply["type"], reply["code"], reply["id"], reply["source"]) == ("error", code, rid, "gateway"), \
                (frame[:80], reply)
            assert reply["message"]
        ok = await reply_to(ws, {"type": "generate", "id": "fine", "prompt_token_ids": list(range(8))})
        assert without_workers(ok) == {"type": "accepted", "id": "fine"}
        assert [j.id for j in await wait_jobs(r, 1)] == ["fine"]  # nothing refused reached Redis
        await asyncio.sleep(0.2)
        assert await r.xlen(NAMES.requests) == 1
        _, _, metrics = await http_get(gw.url + "metrics")
        assert 'streamer_gateway_errors_total{code="bad_json"} 4' in metrics.decode()
    await r.aclose()


@pytest.mark.anyio
async def test_resume_beyond_the_last_event_is_refused_not_left_waiting(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        assert (await reply_to(ws, {"type": "generate", "id": "q1", "prompt": "x"}))["type"] == "accepted"
        # Queued, no event yet: nothing can have been received.
        async with connect(gw.ws_url) as other:
            reply = await reply_to(other, {"type": "resume", "id": "q1", "after_seq": 0})
            assert (reply["code"], reply["id"]) == ("invalid_request", "q1") and "beyond" in reply["message"]
        await emit(r, "q1", tokens("q1", range(0, 3)))
        for _ in range(3):
            await recv(ws)
        async with connect(gw.ws_url) as other:
            for after in (3, 10**6, 2**63 - 2):
                reply = await reply_to(other, {"type": "resume", "id": "q1", "after_seq": after})
                assert (reply["code"], reply["id"]) == ("invalid_request", "q1"), reply
            # Within what was written: resumed, and the rest arrives live.
            await send(other, {"type": "resume", "id": "q1", "after_seq": 2})
            await asyncio.sleep(0.2)
            await emit(r, "q1", [done("q1", 3)])
            assert (await recv(other))["seq"] == 3
            reply = await reply_to(other, {"type": "resume", "id": "q1", "after_seq": 3})
            assert reply["code"] == "already_finished"
    await r.aclose()


@pytest.mark.anyio
async def test_prompt_limit_is_learned_from_the_workers_heartbeats(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw, connect(gw.ws_url) as ws:
        # No worker announces its context: no gateway check (the worker answers a too long prompt).
        assert (await reply_to(ws, {"type": "generate", "id": "a", "prompt_token_ids": [1] * 100}))["type"] == \
            "accepted"
        await beat(r, "w1", max_model_len=32)
        await beat(r, "w2", max_model_len=64)
        assert (await http_get(gw.url + "readyz"))[0] == 200  # a readiness check refreshes what is known
        reply = await reply_to(ws, {"type": "generate", "id": "b", "prompt_token_ids": [1] * 64})
        assert (reply["code"], reply["id"]) == ("invalid_request", "b") and "at most 63" in reply["message"]
        assert (await reply_to(ws, {"type": "generate", "id": "c", "prompt_token_ids": [1] * 63}))["type"] == \
            "accepted"
    await r.aclose()


@pytest.mark.anyio
async def test_openai_max_tokens_past_the_context_is_refused_as_vllm_does(redis_url: str) -> None:
    """A `max_tokens` the context cannot hold beside the prompt is a 400 in vLLM's words, counted
    exactly for token-id prompts and with the one token a text prompt has at least; nothing is
    pushed. Within the context, or with no bound (chat), the job is pushed."""
    r = aioredis.Redis.from_url(redis_url)
    await r.delete(NAMES.requests)
    async with running_gateway(config(redis_url)) as gw, httpx.AsyncClient(base_url=gw.url + "v1") as http:
        await beat(r, "w1", max_model_len=64)
        assert (await http_get(gw.url + "readyz"))[0] == 200  # a readiness check refreshes what is known
        huge = await http.post("/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 10_000_000})
        assert huge.status_code == 400, huge.text
        assert huge.json()["error"]["message"] == (
            "'max_tokens' or 'max_completion_tokens' is too large: 10000000. This model's maximum context length "
            "is 64 tokens and your request has at least 1 input token (10000000 > 64 - 1).")
        ids = await http.post("/completions", json={"model": "tiny", "prompt": [1] * 10, "max_tokens": 55})
        assert ids.status_code == 400 and "has 10 input tokens (55 > 64 - 10)" in ids.json()["error"]["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 64}
        assert (await http.post("/chat/completions", json=chat)).status_code == 400
        assert await r.xlen(NAMES.requests) == 0  # nothing refused was pushed
        for path, body in (("/completions", {"model": "tiny", "prompt": [1] * 10, "max_tokens": 54}),
                           ("/chat/completions", {**chat, "max_completion_tokens": None})):
            async with http.stream("POST", path, json={**body, "stream": True}) as fits:
                assert fits.status_code == 200
        assert await r.xlen(NAMES.requests) == 2
    await r.aclose()


@pytest.mark.anyio
async def test_liveness_and_readiness(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with running_gateway(config(redis_url)) as gw:
        status, _, body = await http_get(gw.url + "livez")
        assert status == 200 and json.loads(body)["ok"] is True
        for path in ("readyz", "healthz"):  # no worker yet: alive, not ready
            status, _, body = await http_get(gw.url + path)
            assert status == 503 and json.loads(body)["workers"] == []
        await beat(r, "w1")
        for path in ("readyz", "healthz"):
            status, _, body = await http_get(gw.url + path)
            assert status == 200 and [w["name"] for w in json.loads(body)["workers"]] == ["w1"]
    await r.aclose()
    with RedisServer() as own:
        async with running_gateway(config(own.url)) as gw:
            own.stop()
            assert (await http_get(gw.url + "livez"))[0] == 200  # Redis away: still alive ...
            status, _, body = await http_get(gw.url + "readyz")  # ... not ready
            assert status == 503 and json.loads(body)["redis"] is False


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "192.168.1.2", "example.com"))
    assert GatewayConfig(host="0.0.0.0").open_to_all
    assert not GatewayConfig(host="0.0.0.0", api_keys=("k",)).open_to_all
    assert not GatewayConfig(host="127.0.0.1").open_to_all


@pytest.mark.anyio
async def test_no_open_gateway_without_an_explicit_flag(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(UserError, match="--insecure-no-auth"):
        async with running_gateway(config(redis_url, host="0.0.0.0")):
            pass
    async with running_gateway(config(redis_url, host="0.0.0.0", api_keys=("k",))):
        pass
    with caplog.at_level(logging.WARNING, logger="streamer.gateway"):
        async with running_gateway(config(redis_url, host="0.0.0.0", insecure_no_auth=True)) as gw:
            assert (await http_get(f"http://127.0.0.1:{gw.port}/livez"))[0] == 200
    assert any(rec.levelno == logging.WARNING and "INSECURE" in rec.getMessage() for rec in caplog.records)


def test_the_gateway_command_refuses_an_open_gateway(redis_url: str) -> None:
    """`streamer gateway --host 0.0.0.0` without a key ends with one line saying what to do."""
    out = subprocess.run([sys.executable, "-m", "workers.cli", "gateway", "--host", "0.0.0.0", "--port", "0",
                          "--redis", redis_url], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "", "HOME": str(ROOT)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("streamer gateway: error: refusing to serve on 0.0.0.0 without an API key")
    assert "--insecure-no-auth" in out.stderr and "Traceback" not in out.stderr
