"""Tenants: who a request belongs to (the API key that authenticated it), what it may use, and the
check of those limits in Redis before a job is pushed (docs/gateway.md#tenants).

The keys file that names tenants and their limits is read by keys_file.py.

Admission is one Lua script per request (ADMIT_SCRIPT): every gateway, and the workers that end
jobs, share the counters in Redis, so the limits hold across any number of gateways, and nothing
is pushed when they are exceeded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clients.errors import ProtocolError
from clients.protocol import Names
from streamer.sampling_params import SamplingParams
from workers.gateway.keys_file import TenantLimits
from workers.gateway.metrics import Metrics

# What a job without `max_tokens` generates at most (the engine's default), so what it is charged.
DEFAULT_MAX_TOKENS: int = SamplingParams.__dataclass_fields__["max_tokens"].default
DEFAULT_BEAM_WIDTH: int = SamplingParams.__dataclass_fields__["beam_width"].default

# --- tagging jobs --------------------------------------------------------------------------------

def tag(job: dict[str, Any], tenant: str, session: str | None = None) -> dict[str, Any]:
    """The job with the gateway's `tenant` (from the API key), never the client's: a client that
    could name its tenant could use anyone's share and limits. `session`, when given, replaces the
    job's own (the OpenAI API's header or `user`). A tenant's sessions are its own: their names are
    prefixed with it, so two tenants naming the same session never share its routing or its place in
    fair sharing."""
    job.pop("tenant", None)
    if session:
        job["session"] = session
    if tenant:
        job["tenant"] = tenant
        if isinstance(job.get("session"), str) and job["session"]:
            job["session"] = f"{tenant}/{job['session']}"
    return job


def job_id(tenant: str, client_id: str) -> str:
    """The id a tenant's request has in Redis: its own name for it, prefixed with the tenant, so two
    tenants using the same id never meet (keys without a tenant use their ids as they are)."""
    return f"{tenant}/{client_id}" if tenant else client_id


def client_id(tenant: str, request_id: str) -> str:
    """The id a tenant's client knows a request by (job_id's inverse)."""
    prefix = f"{tenant}/"
    return request_id[len(prefix):] if tenant and request_id.startswith(prefix) else request_id


def owner_claim(tenant: str, token: str) -> str:
    """The value of a gateway's claim on an id: whose request it is, and which push made it."""
    return f"{tenant}/{token}"


def may_access(caller: str, claim: bytes | str | None) -> bool:
    """Whether a key of tenant `caller` may read, resume or cancel the request whose claim this is.
    A key without a tenant (`--api-key`: the operator's) may touch any; a tenant's key only its
    tenant's requests (not those of other tenants, nor those pushed without a gateway)."""
    if not caller:
        return True
    if claim is None:
        return False
    text = claim.decode(errors="replace") if isinstance(claim, bytes) else claim
    return text.partition("/")[0] == caller


def check_priority(tenant: str, limits: TenantLimits, jobs: list[dict[str, Any]]) -> None:
    """ProtocolError `invalid_request` for a job more urgent than its tenant may ask for."""
    for job in jobs:
        priority = job.get("priority", 0)
        if isinstance(priority, int) and priority < limits.min_priority:
            raise ProtocolError("invalid_request", f"`priority` {priority} is more urgent than tenant {tenant!r} "
                                f"may use (at least {limits.min_priority}; lower runs first)", job["id"])


# --- what a job is charged -----------------------------------------------------------------------

def charge(job: dict[str, Any], prompt_limit: int = 0) -> int:
    """Tokens a job counts against tokens_per_minute, decided before it runs: its prompt (exact for
    `prompt_token_ids`, else about 4 characters a token) plus the most it may generate (`max_tokens`
    per sample). `max_tokens: null` generates until the context is full: charged up to
    `prompt_limit` (the longest prompt the workers take), or the default when that is not known."""
    prompt = _prompt_tokens(job)
    if job.get("task", "generate") != "generate":  # tokenize, detokenize, embed: the prompt alone
        return prompt
    params = job.get("params") or {}
    samples = _samples(params)
    out = params.get("max_tokens", DEFAULT_MAX_TOKENS)
    if out is None:
        out = max(prompt_limit - prompt, DEFAULT_MAX_TOKENS)
    return prompt + samples * int(out)


def _prompt_tokens(job: dict[str, Any]) -> int:
    ids = job.get("prompt_token_ids")
    if ids is not None:
        return len(ids)
    if job.get("prompt") is not None:
        return max(1, len(job["prompt"]) // 4)
    chars = _text_chars(job.get("messages")) + _text_chars(job.get("tools"))
    return max(1, chars // 4)


def _text_chars(obj: Any) -> int:
    """Characters of every string in a (checked, at most 6 levels deep) messages or tools value."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_text_chars(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(_text_chars(v) for v in obj)
    return 0


def _samples(params: dict[str, Any]) -> int:
    n = params.get("n", 1)
    n = n if isinstance(n, int) and n > 0 else 1
    if params.get("use_beam_search"):
        width = params.get("beam_width", DEFAULT_BEAM_WIDTH)
        return max(n, width if isinstance(width, int) and width > 0 else DEFAULT_BEAM_WIDTH)
    return n


# --- admission in Redis --------------------------------------------------------------------------

# Admit a request's jobs for one tenant, all or none, in one round trip. Time is the Redis server's,
# so gateways with skewed clocks share one window and one expiry. tokens_per_minute counts in fixed
# windows of one minute (window n = [n, n+1) minutes since the epoch): one GET per admission, where
# a sliding log would keep every charge. A concurrency slot frees when one of the tenant's jobs ends,
# which nobody can foresee: its retry-after (1 s) is only a hint for when to look again.
# KEYS[1] = names.tenant_active(t) (ZSET: member = job id, score = expiry ms),
# KEYS[2] = names.tenant_tokens(t) (prefix: the window's counter is KEYS[2]:<minute number>; same
#           hash tag, so the same slot on a cluster).
# ARGV[1] = max_concurrent (0: none), ARGV[2] = tokens_per_minute (0: none), ARGV[3] = slot TTL (ms),
# ARGV[4] = tokens charged, ARGV[5..] = the jobs' ids.
# Returns {1, counter key} when admitted; {0, reason, retry after ms (-1: never fits), in use}.
ADMIT_SCRIPT = """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
local max_concurrent, per_minute = tonumber(ARGV[1]), tonumber(ARGV[2])
local ttl, cost, jobs = tonumber(ARGV[3]), tonumber(ARGV[4]), #ARGV - 4
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if max_concurrent > 0 then
  local active = redis.call('ZCARD', KEYS[1])
  if jobs > max_concurrent then return {0, 'concurrency', -1, active} end
  if active + jobs > max_concurrent then return {0, 'concurrency', 1000, active} end
end
local window = math.floor(now / 60000)
local counter = KEYS[2] .. ':' .. window
if per_minute > 0 then
  local used = tonumber(redis.call('GET', counter) or '0')
  if cost > per_minute then return {0, 'tokens', -1, used} end
  if used + cost > per_minute then return {0, 'tokens', (window + 1) * 60000 - now, used} end
  redis.call('INCRBY', counter, cost)
  redis.call('PEXPIRE', counter, 120000)
end
for i = 5, #ARGV do redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, counter}
"""

# Give back what admission took for jobs that were never pushed.
# KEYS[1] = names.tenant_active(t), KEYS[2] = the window's counter admission returned;
# ARGV[1] = tokens to give back, ARGV[2..] = the jobs' ids. Returns how many ids were removed.
# The counter is only lowered while it exists: once its window expired there is nothing to give back
# (and DECRBY would create a key without a TTL).
RELEASE_SCRIPT = """
local removed = 0
for i = 2, #ARGV do removed = removed + redis.call('ZREM', KEYS[1], ARGV[i]) end
if tonumber(ARGV[1]) > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DECRBY', KEYS[2], ARGV[1])
end
return removed
"""


class RateLimited(ProtocolError):
    """A tenant's limit refuses the request. `retry_after_s`: whole seconds until it may fit (None:
    it never fits, e.g. more tokens than tokens_per_minute; the code is then `request_too_large`)."""

    def __init__(self, tenant: str, reason: str, retry_after_s: int | None, message: str,
                 request_id: str | None = None) -> None:
        super().__init__("rate_limited" if retry_after_s is not None else "request_too_large", message,
                         request_id)
        self.tenant, self.reason, self.retry_after_s = tenant, reason, retry_after_s


@dataclass
class Reservation:
    """What admission took for a request's jobs: their slots, and tokens in one window's counter."""

    tenant: str
    counter: str
    charges: dict[str, int]  # job id -> tokens charged


class TenantGate:
    """The tenants' limits, checked in Redis before each push (`admit`), given back when the push
    fails (`release`); the workers remove a finished job from `names.tenant_active(tenant)`."""

    def __init__(self, redis: Any, names: Names, tenants: Mapping[str, TenantLimits], metrics: Metrics,
                 ttl_s: float) -> None:
        self.redis, self.names, self.tenants, self.metrics = redis, names, dict(tenants), metrics
        self.ttl_ms = max(1, int(ttl_s * 1000))  # a lost job (its worker died for good) frees its slot then
        self._admit = redis.register_script(ADMIT_SCRIPT)
        self._release = redis.register_script(RELEASE_SCRIPT)
        metrics.add_tenants(list(self.tenants))

    async def register_shares(self) -> None:
        """Each tenant's share in `names.tenants`, for the workers' fair sharing. Several gateways
        with the same file write the same values; a tenant another gateway names is left alone."""
        if self.tenants:
            await self.redis.hset(self.names.tenants,
                                  mapping={t: _share_text(lim.share) for t, lim in self.tenants.items()})

    async def admit(self, tenant: str, jobs: list[dict[str, Any]], prompt_limit: int = 0) -> Reservation | None:
        """Take a slot per job and their tokens, all or none; RateLimited when a limit says no.
        None for jobs of no tenant (keys without one): nothing is limited or counted."""
        limits = self.tenants.get(tenant)
        if limits is None:
            return None
        check_priority(tenant, limits, jobs)
        charges = {job["id"]: charge(job, prompt_limit) for job in jobs}
        total = sum(charges.values())
        keys = [self.names.tenant_active(tenant), self.names.tenant_tokens(tenant)]
        args = [limits.max_concurrent, limits.tokens_per_minute, self.ttl_ms, total, *charges]
        result = await self._admit(keys=keys, args=args)
        if int(result[0]) != 1:
            reason = _text(result[1])
            self.metrics.tenant_rejected(tenant, reason, len(jobs))
            raise _refusal(tenant, limits, reason, int(result[2]), int(result[3]), len(jobs), total,
                           jobs[0]["id"] if len(jobs) == 1 else None)
        self.metrics.tenant_admitted(tenant, len(jobs), total)
        return Reservation(tenant, _text(result[1]), charges)

    async def release(self, reservation: Reservation | None, ids: list[str] | None = None) -> None:
        """Give back the slots and tokens of these jobs (default: all of the reservation's), which
        were never pushed."""
        if reservation is None:
            return
        ids = list(reservation.charges) if ids is None else ids
        if not ids:
            return
        tokens = sum(reservation.charges.get(i, 0) for i in ids)
        await self._release(keys=[self.names.tenant_active(reservation.tenant), reservation.counter],
                            args=[tokens, *ids])


def _refusal(tenant: str, limits: TenantLimits, reason: str, retry_ms: int, used: int, jobs: int,
             tokens: int, request_id: str | None) -> RateLimited:
    retry = None if retry_ms < 0 else max(1, math.ceil(retry_ms / 1000))  # Retry-After is whole seconds
    if reason == "concurrency" and retry is None:
        message = (f"the request has {jobs} prompts; tenant {tenant!r} may run at most "
                   f"{limits.max_concurrent} at once")
    elif reason == "concurrency":
        message = (f"tenant {tenant!r} has {used} requests running (limit {limits.max_concurrent}); retry "
                   "when one finishes")
    elif retry is None:
        message = (f"the request needs {tokens} tokens (prompt + max_tokens); tenant {tenant!r} may use "
                   f"{limits.tokens_per_minute} per minute: lower max_tokens or shorten the prompt")
    else:
        message = (f"tenant {tenant!r} is over its tokens per minute: limit {limits.tokens_per_minute}, "
                   f"used {used}, requested {tokens}; retry in {retry} s")
    return RateLimited(tenant, reason, retry, message, request_id)


def _share_text(share: float) -> str:
    share = float(share)
    return str(int(share)) if share.is_integer() else repr(share)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
