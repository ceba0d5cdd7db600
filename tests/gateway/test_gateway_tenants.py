"""Tenants in the gateway (docs/gateway.md#tenants): the keys file that names them, the `tenant` and
`session` the gateway writes into every job, and the limits it checks in Redis before a push: a
refused job never reaches a request stream. A real redis-server and a real gateway; no worker (the
worker's one duty here, removing a finished job from its tenant's active set, is done by the test, as
the contract says)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from test_gateway import NAMES, config, emit, recv, send, tokens, without_workers
from websockets.asyncio.client import ClientConnection, connect

from clients.protocol import Job, decode_job
from workers.cli.main import command_parser
from workers.errors import UserError
from workers.gateway.command import config_from_args
from workers.gateway.config import GatewayConfig
from workers.gateway.keys_file import TenantLimits, read_keys_file
from workers.gateway.server import Gateway, running_gateway
from workers.gateway.tenants import DEFAULT_MAX_TOKENS, charge

KEYS = {"ka": "acme", "kb": "beta"}


def tenant_config(redis_url: str, acme: TenantLimits, beta: TenantLimits | None = None,
                  **overrides: Any) -> GatewayConfig:
    """A gateway whose key `ka` is tenant acme, `kb` tenant beta, and `plain` has no tenant."""
    tenants = {"acme": acme, "beta": beta or TenantLimits()}
    return config(redis_url, api_keys=("plain",), tenants=tenants, key_tenants=dict(KEYS), **overrides)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        yield r
    finally:
        await r.aclose()


def ws_as(gw: Gateway, key: str) -> Any:
    return connect(gw.ws_url, additional_headers={"Authorization": f"Bearer {key}"})


def http_as(gw: Gateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url + "v1", headers={"Authorization": f"Bearer {key}"}, timeout=10)


async def generate(ws: ClientConnection, **frame: Any) -> dict[str, Any]:
    """Send a generate frame; its first answer (`accepted` or an `error`)."""
    await send(ws, {"type": "generate", **frame})
    return await recv(ws)


async def queued_jobs(r: aioredis.Redis) -> list[Job]:
    """Every job on every request stream (`llm:requests`, its lanes, shards and tenants' queues)."""
    jobs = []
    async for stream in r.scan_iter(match=f"{NAMES.requests}*", _type="stream"):
        jobs += [decode_job(fields) for _, fields in await r.xrange(stream)]
    return jobs


def own(rid: str) -> str:
    """The id a tenant's client gave, from the namespaced id its job has in Redis (`acme/one` ->
    `one`); these tests' own ids have no `/`."""
    return rid.rpartition("/")[2]


async def job_ids(r: aioredis.Redis) -> set[str]:
    """The ids of the queued jobs as their clients named them."""
    return {own(job.id) for job in await queued_jobs(r)}


async def the_job(r: aioredis.Redis, rid: str, timeout: float = 5.0) -> Job:
    async def poll() -> Job:
        while True:
            found = [job for job in await queued_jobs(r) if own(job.id) == rid]
            if found:
                return found[0]
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(poll(), timeout)


async def active(r: aioredis.Redis, tenant: str) -> set[str]:
    return {own(m.decode()) for m in await r.zrange(NAMES.tenant_active(tenant), 0, -1)}


async def tokens_used(r: aioredis.Redis, tenant: str) -> int:
    total = 0
    async for key in r.scan_iter(match=NAMES.tenant_tokens(tenant) + ":*"):
        total += int(await r.get(key) or 0)
    return total


async def away_from_minute_end(r: aioredis.Redis, margin_ms: int = 8000) -> None:
    """tokens_per_minute counts in fixed minutes of Redis time: a check that spans the end of one
    would see a fresh window. Wait for the next minute when this one ends within `margin_ms`."""
    seconds, micros = await r.time()
    into = (seconds * 1000 + micros // 1000) % 60_000
    if into > 60_000 - margin_ms:
        await asyncio.sleep((60_000 - into) / 1000 + 0.05)


def metric(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(f"streamer_gateway_{name}", labels) or 0.0


def completion(prompt: str = "x", **fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, **fields}


# --- limits --------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_over_max_concurrent_is_refused_on_both_apis_and_never_pushed(redis_url: str,
                                                                           redis: aioredis.Redis) -> None:
    async with running_gateway(tenant_config(redis_url, TenantLimits(max_concurrent=1))) as gw, \
            ws_as(gw, "ka") as ws, http_as(gw, "ka") as http:
        assert (await generate(ws, id="first", prompt="x"))["type"] == "accepted"
        assert await active(redis, "acme") == {"first"}
        refused = await generate(ws, id="second", prompt="x")
        assert refused["type"] == "error" and refused["code"] == "rate_limited", refused
        assert refused["id"] == "second" and refused["retry_after"] >= 1
        r = await http.post("/completions", json=completion(), headers={"X-Request-Id": "third"})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and error["message"]
        assert await job_ids(redis) == {"first"}  # neither refused job reached a stream
        assert await active(redis, "acme") == {"first"}
        # Another tenant is not limited by acme's jobs.
        async with ws_as(gw, "kb") as other:
            assert (await generate(other, id="beta-1", prompt="x"))["type"] == "accepted"
        # The worker ends `first` and removes it (its side of the contract): acme has room again,
        # and the refused id can be used now (its claim was given back).
        await redis.zrem(NAMES.tenant_active("acme"), "acme/first")  # the job's id in Redis
        assert (await generate(ws, id="second", prompt="x"))["type"] == "accepted"
        assert await job_ids(redis) == {"first", "beta-1", "second"}
        assert metric(gw, "tenant_admitted_total", tenant="acme") == 2
        assert metric(gw, "tenant_rejected_total", tenant="acme", reason="concurrency") == 2
        assert metric(gw, "tenant_rejected_total", tenant="acme", reason="tokens") == 0
        assert metric(gw, "errors_total", code="rate_limited") == 1  # the /ws error frame


@pytest.mark.anyio
async def test_a_lost_job_frees_its_slot_when_its_reservation_expires(redis_url: str,
                                                                    redis: aioredis.Redis) -> None:
    cfg = tenant_config(redis_url, TenantLimits(max_concurrent=2), request_ttl_s=1.0)
    async with running_gateway(cfg) as gw, ws_as(gw, "ka") as ws:
        assert (await generate(ws, id="lost", prompt="x"))["type"] == "accepted"
        await asyncio.sleep(0.5)
        assert (await generate(ws, id="fresh", prompt="x"))["type"] == "accepted"  # keeps the set alive
        assert (await generate(ws, id="next", prompt="x"))["code"] == "rate_limited"
        await asyncio.sleep(0.7)  # nobody ever ended `lost`: its slot expired with request_ttl_s
        assert (await generate(ws, id="next", prompt="x"))["type"] == "accepted"
        assert await active(redis, "acme") == {"fresh", "next"}


@pytest.mark.anyio
async def test_over_tokens_per_minute_is_refused_on_both_apis_and_never_pushed(redis_url: str,
                                                                              redis: aioredis.Redis) -> None:
    await away_from_minute_end(redis)
    async with running_gateway(tenant_config(redis_url, TenantLimits(tokens_per_minute=100))) as gw, \
            ws_as(gw, "ka") as ws, http_as(gw, "ka") as http:
        # 50 prompt tokens + 40 to generate: 90 of the minute's 100.
        frame = await generate(ws, id="big", prompt_token_ids=list(range(50)), params={"max_tokens": 40})
        assert frame["type"] == "accepted", frame
        assert await tokens_used(redis, "acme") == 90
        # 8 + 4 = 12 more would pass 100.
        refused = await generate(ws, id="more", prompt_token_ids=list(range(8)), params={"max_tokens": 4})
        assert refused["code"] == "rate_limited" and 1 <= refused["retry_after"] <= 60, refused
        assert "limit 100, used 90, requested 12" in refused["message"]
        r = await http.post("/completions", json=completion("x" * 40, max_tokens=4),  # 10 + 4 tokens
                            headers={"X-Request-Id": "oa-more"})
        assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60, r.text
        assert r.json()["error"]["type"] == "tokens" and r.json()["error"]["code"] == "rate_limit_exceeded"
        # What still fits is admitted: 5 + 4 = 9 (a refused request charged nothing).
        frame = await generate(ws, id="small", prompt_token_ids=list(range(5)), params={"max_tokens": 4})
        assert frame["type"] == "accepted", frame
        # More than a whole minute allows can never fit: refused without a retry-after.
        never = await generate(ws, id="huge", prompt="x", params={"max_tokens": 500})
        assert never["code"] == "request_too_large" and "retry_after" not in never, never
        r = await http.post("/completions", json=completion(max_tokens=500))
        assert r.status_code == 429 and "Retry-After" not in r.headers
        assert r.json()["error"]["code"] == "request_too_large"
        assert await job_ids(redis) == {"big", "small"}
        assert await tokens_used(redis, "acme") == 99
        assert metric(gw, "tenant_tokens_charged_total", tenant="acme") == 99
        assert metric(gw, "tenant_rejected_total", tenant="acme", reason="tokens") == 4


@pytest.mark.anyio
async def test_all_prompts_of_a_request_are_admitted_together_or_not_at_all(redis_url: str,
                                                                          redis: aioredis.Redis) -> None:
    async with running_gateway(tenant_config(redis_url, TenantLimits(max_concurrent=3))) as gw, \
            http_as(gw, "ka") as http:
        r = await http.post("/completions", json=completion(["a", "b", "c", "d"]))
        assert r.status_code == 429 and r.json()["error"]["code"] == "request_too_large"  # 4 > 3, ever
        async with ws_as(gw, "ka") as ws:
            assert (await generate(ws, id="one", prompt="x"))["type"] == "accepted"
        r = await http.post("/completions", json=completion(["a", "b", "c"]), headers={"X-Request-Id": "abc"})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text  # 1 + 3 > 3: none of them
        assert await job_ids(redis) == {"one"}
        assert await active(redis, "acme") == {"one"}


@pytest.mark.anyio
async def test_a_failed_push_gives_the_reservation_back(redis_url: str, redis: aioredis.Redis) -> None:
    await away_from_minute_end(redis)
    limits = TenantLimits(max_concurrent=5, tokens_per_minute=10_000)
    async with running_gateway(tenant_config(redis_url, limits)) as gw, ws_as(gw, "ka") as ws, \
            http_as(gw, "ka") as http:
        real_push = gw.hub.push
        pushes = 0

        async def push_fails_after(n: int) -> Any:
            async def push(job: dict[str, Any], claim: str) -> Any:
                nonlocal pushes
                pushes += 1
                if pushes > n:
                    raise ConnectionError("Redis went away")  # as redis-py raises it
                return await real_push(job, claim)
            return push

        gw.hub.push = await push_fails_after(0)  # type: ignore[method-assign]
        # `accepted` goes out just before the push; the push's failure follows it.
        assert (await generate(ws, id="w1", prompt_token_ids=[1, 2, 3], params={"max_tokens": 7}))["type"] == "accepted"
        frame = await recv(ws)
        assert frame["code"] == "redis_unavailable", frame
        assert await active(redis, "acme") == set() and await tokens_used(redis, "acme") == 0
        # Three prompts; the second push fails: the first was pushed (the gateway cancels it, and the
        # worker that ends it frees its slot), the other two are given back at once.
        pushes = 0
        gw.hub.push = await push_fails_after(1)  # type: ignore[method-assign]
        r = await http.post("/completions", json=completion([[1, 2], [3, 4], [5, 6]], max_tokens=3),
                            headers={"X-Request-Id": "oa"})
        assert r.status_code == 503, r.text
        assert await active(redis, "acme") == {"oa.0"}
        assert await tokens_used(redis, "acme") == 5  # 2 + 3 for oa.0 only
        assert await job_ids(redis) == {"oa.0"}
        gw.hub.push = real_push  # type: ignore[method-assign]
        assert (await generate(ws, id="w1", prompt="x"))["type"] == "accepted"  # the id is free again


# --- tagging -------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_jobs_carry_the_keys_tenant_never_the_clients(redis_url: str, redis: aioredis.Redis) -> None:
    async with running_gateway(tenant_config(redis_url, TenantLimits(max_concurrent=10))) as gw:
        async with ws_as(gw, "ka") as ws:
            assert (await generate(ws, id="own", prompt="x"))["type"] == "accepted"
            assert (await generate(ws, id="forged", prompt="x", tenant="beta"))["type"] == "accepted"
            assert (await generate(ws, id="junk", prompt="x", tenant="not a name!"))["type"] == "accepted"
        async with ws_as(gw, "plain") as ws:  # a key without a tenant: the job has none
            assert (await generate(ws, id="untagged", prompt="x", tenant="acme"))["type"] == "accepted"
        for rid in ("own", "forged", "junk"):
            assert (await the_job(redis, rid)).tenant == "acme"
        assert (await the_job(redis, "untagged")).tenant == ""
        assert await active(redis, "acme") == {"own", "forged", "junk"}
        assert await active(redis, "beta") == set()


@pytest.mark.anyio
async def test_sessions_from_frames_user_and_x_session_id(redis_url: str, redis: aioredis.Redis) -> None:
    async with running_gateway(tenant_config(redis_url, TenantLimits())) as gw, http_as(gw, "kb") as http:
        async with ws_as(gw, "kb") as ws:
            assert (await generate(ws, id="ws-s", prompt="x", session="conv-1"))["type"] == "accepted"
            bad = await generate(ws, id="ws-bad", prompt="x", session="")
            assert bad["code"] == "invalid_request", bad

        async def open_stream(body: dict[str, Any], **headers: str) -> int:
            """Start a streamed answer and go away (nobody serves it: only its job matters)."""
            async with http.stream("POST", "/completions", json={**body, "stream": True},
                                   headers=headers) as r:
                return r.status_code

        assert await open_stream(completion(user="u-1"), **{"X-Request-Id": "by-user"}) == 200
        assert await open_stream(completion(user="u-1"), **{"X-Request-Id": "by-header",
                                                            "X-Session-Id": "h-1"}) == 200
        assert await open_stream(completion(), **{"X-Request-Id": "none"}) == 200
        r = await http.post("/completions", json=completion(user="u" * 300))
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        async with http.stream("POST", "/chat/completions", json=chat,
                               headers={"X-Request-Id": "chat", "X-Session-Id": "h-2"}) as r:
            assert r.status_code == 200
        # A tenant's sessions are its own (prefixed with its name).
        expected = {"ws-s": "beta/conv-1", "by-user": "beta/u-1", "by-header": "beta/h-1", "none": "",
                    "chat": "beta/h-2"}
        for rid, session in expected.items():
            job = await the_job(redis, rid)
            assert (job.session, job.tenant) == (session, "beta"), rid
        assert "ws-bad" not in await job_ids(redis)


@pytest.mark.anyio
async def test_shares_are_registered_for_the_workers(redis_url: str, redis: aioredis.Redis) -> None:
    cfg = tenant_config(redis_url, TenantLimits(share=3), TenantLimits(share=0.5))
    async with running_gateway(cfg):
        assert await redis.hgetall(NAMES.tenants) == {b"acme": b"3", b"beta": b"0.5"}


@pytest.mark.anyio
async def test_without_tenants_nothing_is_limited_or_written(redis_url: str, redis: aioredis.Redis) -> None:
    async with running_gateway(config(redis_url, api_keys=("k",))) as gw, ws_as(gw, "k") as ws:
        assert (await generate(ws, id="a", prompt="x", tenant="acme"))["type"] == "accepted"
        assert (await the_job(redis, "a")).tenant == ""
        assert not await redis.exists(NAMES.tenants, NAMES.tenant_active("acme"))


# --- the keys file -------------------------------------------------------------------------------

def gateway_config(*args: str) -> GatewayConfig:
    return config_from_args(command_parser("gateway").parse_args(list(args)))


def test_one_key_per_line_still_works_and_has_no_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nk-one\n\n  k-two  \n# k-old\n")
    cfg = gateway_config("--api-keys-file", str(path), "--api-key", "k-flag")
    assert cfg.api_keys == ("k-flag", "k-one", "k-two")
    assert cfg.tenants == {} and cfg.key_tenants == {} and cfg.tenant_of("k-one") == ""


def test_a_json_or_toml_keys_file_names_tenants(tmp_path: Path) -> None:
    doc = {"tenants": {"acme": {"share": 3, "max_concurrent": 8, "tokens_per_minute": 200000, "min_priority": -10},
                       "beta": {"share": 1.5}},
           "keys": {"sk-a1": "acme", "sk-a2": "acme", "sk-b": "beta"}}
    expected = {"acme": TenantLimits(3.0, 8, 200000, -10), "beta": TenantLimits(1.5, 0, 0)}
    json_file = tmp_path / "keys.conf"  # JSON told by its content
    json_file.write_text(json.dumps(doc))
    toml_file = tmp_path / "keys.toml"
    toml_file.write_text('[tenants.acme]\nshare = 3\nmax_concurrent = 8\ntokens_per_minute = 200000\n'
                         'min_priority = -10\n'
                         '[tenants.beta]\nshare = 1.5\n[keys]\n"sk-a1" = "acme"\n"sk-a2" = "acme"\n"sk-b" = "beta"\n')
    for path in (json_file, toml_file):
        cfg = gateway_config("--api-keys-file", str(path), "--api-key", "k-flag")
        assert cfg.tenants == expected, path
        assert cfg.api_keys == ("k-flag", "sk-a1", "sk-a2", "sk-b")
        assert [cfg.tenant_of(k) for k in ("sk-a1", "sk-b", "k-flag", None)] == ["acme", "beta", "", ""]


BAD_FILES = [
    ("keys.json", '{"tenants": {}, "keys": {"k": "t"}, "extra": 1}', "unknown field(s) ['extra']"),
    ("keys.json", '{"tenants": {"t": {"shares": 2}}, "keys": {"k": "t"}}', "tenants.t: unknown field(s) ['shares']"),
    ("keys.json", '{"tenants": {"t": {"share": 0}}, "keys": {"k": "t"}}', "tenants.t.share must be a positive"),
    ("keys.json", '{"tenants": {"t": {"share": "big"}}, "keys": {"k": "t"}}', "tenants.t.share must be a positive"),
    ("keys.json", '{"tenants": {"t": {"max_concurrent": 1.5}}, "keys": {"k": "t"}}',
     "tenants.t.max_concurrent must be a whole number"),
    ("keys.json", '{"tenants": {"t": {"tokens_per_minute": -3}}, "keys": {"k": "t"}}',
     "tenants.t.tokens_per_minute must be a whole number"),
    ("keys.json", '{"tenants": {"t": {"max_concurrent": true}}, "keys": {"k": "t"}}',
     "tenants.t.max_concurrent must be a whole number"),
    ("keys.json", '{"tenants": {"a b": {}}, "keys": {"k": "a b"}}', "tenant name 'a b' must be"),
    ("keys.json", '{"tenants": {"t": {}}, "keys": {"sk-secret-key": "nobody"}}',
     "sk-s... names tenant 'nobody', which is not in `tenants`"),
    ("keys.json", '{"tenants": {"t": {}}, "keys": {}}', "`keys` must be a non-empty object"),
    ("keys.json", '{"tenants": {"t": {}}}', "`keys` must be a non-empty object"),
    ("keys.json", '{"tenants": {"t": {}}, "keys": {"a key": "t"}}', "without spaces"),
    ("keys.json", '{"tenants": [], "keys": {"k": "t"}}', "`tenants` must be an object"),
    ("keys.json", '{"tenants": {"t": {}}, "keys": {"k": "t", "k": "t"}}', "is given twice"),
    ("keys.json", '{"tenants": {"t": {}}, "keys": {"k": "t"},}', "is not valid JSON"),
    ("keys", '{"keys": {"k": "t"}', "is not valid JSON"),  # JSON by its content
    ("keys.json", '["k"]', "must be an object with `tenants` and `keys`"),
    ("keys.toml", '[tenants.t]\nshare = -1\n[keys]\nk = "t"\n', "tenants.t.share must be a positive"),
    ("keys.toml", "[tenants.t\n", "is not valid TOML"),
    ("keys.json", '{"tenants": {"t": {"min_priority": -1e99}}, "keys": {"k": "t"}}',
     "tenants.t.min_priority must be a whole number"),
]


@pytest.mark.parametrize(("name", "text", "message"), BAD_FILES)
def test_a_bad_keys_file_says_what_is_wrong(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError) as refused:
        read_keys_file(path)
    assert message in str(refused.value) and str(path) in str(refused.value)
    assert "sk-secret-key" not in str(refused.value)  # a key is never printed whole


def test_a_missing_keys_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read --api-keys-file"):
        gateway_config("--api-keys-file", str(tmp_path / "nope"))


def test_config_refuses_keys_of_unknown_tenants() -> None:
    with pytest.raises(ValueError, match="not in tenants"):
        GatewayConfig(key_tenants={"k": "ghost"})
    assert GatewayConfig(tenants={"t": TenantLimits()}, key_tenants={"k": "t"}).api_keys == ("k",)


# --- charges -------------------------------------------------------------------------------------

def test_charge_is_the_prompt_plus_the_most_it_may_generate() -> None:
    assert DEFAULT_MAX_TOKENS == 16  # the engine's default max_tokens
    assert charge({"prompt_token_ids": [1] * 10, "params": {"max_tokens": 5}}) == 15
    assert charge({"prompt": "x" * 40}) == 10 + 16  # about 4 characters a token; the default max_tokens
    assert charge({"prompt": "hi", "params": {"max_tokens": 3, "n": 2}}) == 1 + 6
    assert charge({"prompt": "hi", "params": {"max_tokens": 3, "use_beam_search": True}}) == 1 + 12
    messages = [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": [{"type": "text",
                                                                                         "text": "y" * 20}]}]
    assert charge({"messages": messages, "params": {"max_tokens": 1}}) == (4 + 20 + 9 + 4 + 20) // 4 + 1
    # No bound on the answer: up to the longest prompt the workers take, or the default if unknown.
    assert charge({"prompt_token_ids": [1] * 10, "params": {"max_tokens": None}}, prompt_limit=100) == 100
    assert charge({"prompt_token_ids": [1] * 10, "params": {"max_tokens": None}}) == 10 + 16


# --- isolation -----------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_tenant_cannot_ask_for_a_more_urgent_lane_than_it_is_allowed(redis_url: str,
                                                                           redis: aioredis.Redis) -> None:
    """acme may go down to priority -5; beta has the default bound (0): nothing more urgent than
    everyone's default. Refused on both APIs, nothing pushed; keys without a tenant are not bound."""
    async with running_gateway(tenant_config(redis_url, TenantLimits(min_priority=-5))) as gw, \
            http_as(gw, "kb") as beta_http:
        async with ws_as(gw, "ka") as ws:
            assert (await generate(ws, id="a-ok", prompt="x", priority=-5))["type"] == "accepted"
            refused = await generate(ws, id="a-urgent", prompt="x", priority=-2147483648)
            assert (refused["code"], refused["id"]) == ("invalid_request", "a-urgent"), refused
        async with ws_as(gw, "kb") as ws:
            assert (await generate(ws, id="b-ok", prompt="x", priority=3))["type"] == "accepted"
            assert (await generate(ws, id="b-urgent", prompt="x", priority=-1))["code"] == "invalid_request"
        r = await beta_http.post("/completions", json=completion(priority=-1), headers={"X-Request-Id": "b-oa"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        async with ws_as(gw, "plain") as ws:
            assert (await generate(ws, id="p-urgent", prompt="x", priority=-100))["type"] == "accepted"
        assert await job_ids(redis) == {"a-ok", "b-ok", "p-urgent"}
        # The refused ids were given back: the same id at an allowed priority goes through.
        async with ws_as(gw, "kb") as ws:
            assert (await generate(ws, id="b-urgent", prompt="x"))["type"] == "accepted"


@pytest.mark.anyio
async def test_only_the_requests_tenant_can_read_resume_or_cancel_it(redis_url: str,
                                                                    redis: aioredis.Redis) -> None:
    """beta knows acme's request ids: it can neither resume (/ws or the OpenAI API) nor cancel them,
    and is told they do not exist; acme can, and so can a key without a tenant (the operator's)."""
    async with running_gateway(tenant_config(redis_url, TenantLimits())) as gw, \
            http_as(gw, "ka") as acme_http, http_as(gw, "kb") as beta_http:
        async with ws_as(gw, "ka") as ws:
            assert (await generate(ws, id="secret", prompt="x"))["type"] == "accepted"
        async with acme_http.stream("POST", "/completions", json=completion(stream=True),
                                    headers={"X-Request-Id": "secret-oa"}) as r:
            assert r.status_code == 200
        for rid in ("acme/secret", "acme/secret-oa"):  # their ids in Redis: the tenant's namespace
            await emit(redis, rid, tokens(rid, range(0, 2)))
        async with ws_as(gw, "kb") as ws:
            for frame in ({"type": "resume", "id": "secret", "after_seq": -1}, {"type": "cancel", "id": "secret"}):
                await send(ws, frame)
                answer = await recv(ws)
                assert (answer["type"], answer["code"]) == ("error", "unknown_request"), answer
        for client in (beta_http,):
            r = await client.get("/streams/secret-oa")
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_request", r.text
            r = await client.post("/completions", json=completion(stream=True),
                                  headers={"Last-Event-ID": "secret-oa:0"})
            assert r.status_code == 404, r.text
        assert not await redis.exists(NAMES.cancelled("acme/secret"))
        async with ws_as(gw, "ka") as ws:  # its own tenant resumes it, by the id it gave
            await send(ws, {"type": "resume", "id": "secret", "after_seq": -1})
            assert [((e := await recv(ws))["seq"], e["id"]) for _ in range(2)] == [(0, "secret"), (1, "secret")]
        async with ws_as(gw, "plain") as ws:  # and the operator's key may cancel anything, by its full id
            await send(ws, {"type": "cancel", "id": "acme/secret"})
            await asyncio.sleep(0.3)
        assert await redis.exists(NAMES.cancelled("acme/secret"))


@pytest.mark.anyio
async def test_two_tenants_naming_the_same_session_do_not_share_it(redis_url: str, redis: aioredis.Redis) -> None:
    async with running_gateway(tenant_config(redis_url, TenantLimits())) as gw:
        for key, rid in (("ka", "a-s"), ("kb", "b-s")):
            async with ws_as(gw, key) as ws:
                assert (await generate(ws, id=rid, prompt="x", session="chat-1"))["type"] == "accepted"
        sessions = {(await the_job(redis, rid)).session for rid in ("a-s", "b-s")}
        assert sessions == {"acme/chat-1", "beta/chat-1"}
        assert NAMES.session("acme/chat-1") != NAMES.session("beta/chat-1")


@pytest.mark.anyio
async def test_two_tenants_may_use_the_same_request_id_without_meeting(redis_url: str,
                                                                        redis: aioredis.Redis) -> None:
    """acme and beta both name a request `same`, on /ws and on the OpenAI API: both are accepted, each
    streams and resumes its own, and every frame names the id the client gave."""
    async with running_gateway(tenant_config(redis_url, TenantLimits())) as gw, \
            http_as(gw, "ka") as acme_http, http_as(gw, "kb") as beta_http:
        for key in ("ka", "kb"):
            async with ws_as(gw, key) as ws:
                assert without_workers(await generate(ws, id="same", prompt="x")) == {"type": "accepted",
                                                                                     "id": "same"}
        for http in (acme_http, beta_http):
            async with http.stream("POST", "/completions", json=completion(stream=True),
                                   headers={"X-Request-Id": "same-oa"}) as r:
                assert r.status_code == 200 and r.headers["X-Request-Id"] == "same-oa"
        assert {job.id for job in await queued_jobs(redis)} == {"acme/same", "beta/same", "acme/same-oa",
                                                                "beta/same-oa"}
        for tenant, key in (("acme", "ka"), ("beta", "kb")):
            await emit(redis, f"{tenant}/same", tokens(f"{tenant}/same", range(0, 1), text=tenant))
            async with ws_as(gw, key) as ws:
                await send(ws, {"type": "resume", "id": "same", "after_seq": -1})
                event = await recv(ws)
                assert (event["id"], event["text"]) == ("same", f"{tenant}0"), event
