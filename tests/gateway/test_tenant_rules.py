"""The tenant rules of workers/gateway/tenants.py as pure functions, each at its edges: whose requests a
key may touch, the most urgent priority a tenant may ask for, what a job is charged, and the exact
refusal a client gets for each limit. The same rules against a real gateway and Redis are in
test_gateway_tenants.py."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from clients.errors import ProtocolError
from clients.names import Names
from workers.gateway.keys_file import TenantLimits
from workers.gateway.metrics import Metrics
from workers.gateway.tenants import (
    DEFAULT_MAX_TOKENS,
    RateLimited,
    TenantGate,
    _refusal,
    charge,
    check_priority,
    client_id,
    job_id,
    may_access,
    owner_claim,
)


@pytest.mark.parametrize(("caller", "claim", "allowed"), [
    ("", None, True), ("", b"acme/t1", True),  # the operator's key (no tenant) touches any request
    ("acme", owner_claim("acme", "t1").encode(), True), ("acme", "acme/t1", True),
    ("acme", b"beta/t1", False), ("acme", None, False),  # another tenant's, or pushed without a gateway
    ("acme", b"acme/x/y", True), ("acme/x", b"acme/x/y", False),  # the tenant is what comes before the first /
    ("acme", b"\xffacme/t1", False),  # not UTF-8: no tenant's
])
def test_whose_requests_a_key_may_touch(caller: str, claim: bytes | str | None, allowed: bool) -> None:
    assert may_access(caller, claim) is allowed


def test_the_most_urgent_priority_a_tenant_may_ask_for() -> None:
    limits = TenantLimits(min_priority=-2)
    check_priority("acme", limits, [{"id": "a", "priority": -2}, {"id": "b"}, {"id": "c", "priority": 5}])
    with pytest.raises(ProtocolError) as refused:
        check_priority("acme", limits, [{"id": "a", "priority": -2}, {"id": "b", "priority": -3}])
    assert (refused.value.code, refused.value.request_id) == ("invalid_request", "b")
    assert refused.value.message == ("`priority` -3 is more urgent than tenant 'acme' may use (at least -2; "
                                     "lower runs first)")
    # A job without a priority has the default, 0: refused where even that is too urgent.
    with pytest.raises(ProtocolError):
        check_priority("acme", TenantLimits(min_priority=1), [{"id": "b"}])


def test_a_jobs_charge_counts_only_text_in_its_messages() -> None:
    messages = [{"role": "user", "content": "x" * 40, "name": "u"}, {"role": "assistant", "content": None}]
    # 40 + 4 + 1 + 9 + 1 characters of text ("user", "u", "assistant"; None is no text) -> 13 tokens.
    assert charge({"messages": messages, "params": {"max_tokens": 7}}) == 55 // 4 + 7


@pytest.mark.parametrize(("reason", "retry_ms", "retry", "message"), [
    ("concurrency", -1, None, "the request has 3 prompts; tenant 'acme' may run at most 2 at once"),
    ("concurrency", 1000, 1, "tenant 'acme' has 2 requests running (limit 2); retry when one finishes"),
    ("tokens", -1, None, "the request needs 900 tokens (prompt + max_tokens); tenant 'acme' may use 500 per "
                         "minute: lower max_tokens or shorten the prompt"),
    ("tokens", 1, 1, "tenant 'acme' is over its tokens per minute: limit 500, used 2, requested 900; retry in 1 s"),
    ("tokens", 1001, 2, "tenant 'acme' is over its tokens per minute: limit 500, used 2, requested 900; retry in "
                        "2 s"),  # whole seconds, rounded up
])
def test_each_refusal_says_what_and_when(reason: str, retry_ms: int, retry: int | None, message: str) -> None:
    limits = TenantLimits(max_concurrent=2, tokens_per_minute=500)
    refused = _refusal("acme", limits, reason, retry_ms, used=2, jobs=3, tokens=900, request_id="r:1")
    assert (refused.tenant, refused.reason, refused.retry_after_s, refused.message, refused.request_id) == (
        "acme", reason, retry, message, "r:1")
    assert refused.code == ("request_too_large" if retry is None else "rate_limited")


@pytest.mark.anyio
async def test_release_gives_back_exactly_the_named_jobs_or_all(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    names = Names()
    gate = TenantGate(r, names, {"acme": TenantLimits(max_concurrent=5, tokens_per_minute=10_000)}, Metrics(), 60)
    jobs = [{"id": f"j{i}", "prompt": "x" * 40, "params": {"max_tokens": 10 * (i + 1)}} for i in range(3)]
    reservation = await gate.admit("acme", jobs)
    assert reservation is not None and reservation.charges == {"j0": 20, "j1": 30, "j2": 40}

    async def held() -> tuple[list[bytes], int]:
        return sorted(await r.zrange(names.tenant_active("acme"), 0, -1)), int(await r.get(reservation.counter))

    assert await held() == ([b"j0", b"j1", b"j2"], 90)
    await gate.release(reservation, ["j1", "never-admitted"])  # an id it does not hold charges nothing
    assert await held() == ([b"j0", b"j2"], 60)
    await gate.release(reservation, [])
    assert await held() == ([b"j0", b"j2"], 60)
    other = await gate.admit("acme", [{"id": "k", "prompt": "x" * 40, "params": {"max_tokens": 5}}])
    assert await held() == ([b"j0", b"j2", b"k"], 75)
    await gate.release(other)  # all of that reservation's: nothing of the first
    assert await held() == ([b"j0", b"j2"], 60)
    await r.aclose()


@pytest.mark.parametrize(("params", "samples"), [
    ({}, 1), ({"n": 3}, 3), ({"n": 0}, 1), ({"n": "3"}, 1),  # n: a positive int, else one sample
    ({"n": 2, "use_beam_search": True}, 4), ({"n": 6, "use_beam_search": True}, 6),  # beams: the width, 4 by default
    ({"use_beam_search": True, "beam_width": 2}, 2), ({"use_beam_search": True, "beam_width": 1}, 1),
    ({"use_beam_search": True, "beam_width": 0}, 4), ({"use_beam_search": True, "beam_width": "8"}, 4),
])
def test_a_job_is_charged_per_sample_or_beam(params: dict, samples: int) -> None:
    assert charge({"prompt_token_ids": [1] * 10, "params": {**params, "max_tokens": 5}}) == 10 + samples * 5


def test_a_jobs_prompt_is_charged_in_estimated_tokens() -> None:
    assert charge({"prompt": "x" * 41, "params": {"max_tokens": 0}}) == 10  # 41 // 4, a whole number
    assert type(charge({"prompt": "x" * 41, "params": {"max_tokens": 0}})) is int
    assert charge({"prompt": "", "params": {"max_tokens": 0}}) == 1  # at least a token
    tools = [{"type": "function", "function": {"name": "f" * 20}}]  # "function" + 20 characters
    assert charge({"messages": [{"role": "user", "content": "x" * 12}], "tools": tools, "params": {"max_tokens": 0}}) \
        == (4 + 12 + 8 + 20) // 4
    assert charge({"messages": [{"role": "u", "content": ""}], "params": {"max_tokens": 0}}) == 1
    # No max_tokens: the default; null: up to the longest prompt the workers take (at least the default).
    assert charge({"prompt_token_ids": [1], "params": {}}, prompt_limit=100_001) == 1 + DEFAULT_MAX_TOKENS
    assert charge({"prompt_token_ids": [1], "params": {"max_tokens": None}}, prompt_limit=100_001) == 100_001


def test_a_clients_id_is_its_request_id_less_its_own_tenant() -> None:
    assert client_id("acme", job_id("acme", "r:1")) == "r:1" and job_id("", "r:1") == "r:1"
    assert client_id("", "acme/r:1") == "acme/r:1" and client_id("acme", "beta/r:1") == "beta/r:1"


@pytest.mark.anyio
async def test_admission_refuses_naming_the_tenant_the_prompts_and_the_request(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    limits = {"acme": TenantLimits(max_concurrent=1, tokens_per_minute=1000, min_priority=-1)}
    gate = TenantGate(r, Names(), limits, Metrics(), 60)
    two = [{"id": rid, "prompt": "x", "params": {"max_tokens": 1}} for rid in ("a", "b")]
    with pytest.raises(RateLimited) as refused:
        await gate.admit("acme", two)
    assert refused.value.message == "the request has 2 prompts; tenant 'acme' may run at most 1 at once"
    assert refused.value.request_id is None  # several prompts: no one request id
    with pytest.raises(ProtocolError, match="tenant 'acme' may use"):
        await gate.admit("acme", [{"id": "p", "prompt": "x", "priority": -2, "params": {"max_tokens": 1}}])
    unbounded = [{"id": "c", "prompt_token_ids": [1] * 10, "params": {"max_tokens": None}}]
    with pytest.raises(RateLimited) as too_big:  # charged up to the prompt limit given: over 1000 a minute
        await gate.admit("acme", unbounded, prompt_limit=5000)
    assert (too_big.value.request_id, too_big.value.code) == ("c", "request_too_large")
    assert "the request needs 5000 tokens" in too_big.value.message
    await r.aclose()
