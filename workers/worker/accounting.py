"""What a worker tells the other submitters and workers about the jobs it serves (docs/scheduling.md):
which prefixes its cache holds (for routing), a tenant's job that is done (its concurrency slot), and
the service a tenant's job really cost (its fair share). Which worker serves a session is written
at once when a job is taken, not here (affinity.py).

None of it is on a job's path: job tasks record, one loop writes it all every FLUSH_S in one
pipelined round trip, and what a dropped connection kept from going out goes with the next flush.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from clients import scripts
from clients.backoff import TRANSIENT
from clients.names import Names
from clients.protocol import Job
from clients.routing import Segment, answer_chain, prefix_chain
from workers.worker.streams import NO_TENANT

log = logging.getLogger("streamer.worker")

FLUSH_S = 0.25
REWRITE_S = 30.0  # the whole prefix set is written again this often (in case its key was lost)

# KEYS[1] = service clock, KEYS[2] = shares; ARGV[1] = tenant field, ARGV[2] = tokens to add.
_CHARGE = """
local share = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '1')
if share <= 0 then share = 1 end
return redis.call('HINCRBYFLOAT', KEYS[1], ARGV[1], tonumber(ARGV[2]) / share)
"""


def job_dict(job: Job) -> dict[str, Any]:
    """The parts of a job its prefix chain is made of."""
    return {"messages": job.messages, "tools": job.tools, "prompt": job.prompt,
            "prompt_token_ids": job.prompt_token_ids}


class PrefixAdvert:
    """The prefix hashes this worker's cache probably still holds: the chains of recent jobs, least
    recently used dropped first once they add up to more tokens than the KV cache holds (the engine
    evicts its free blocks in the same order)."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self.capacity = capacity  # tokens the KV cache holds (0: unknown, nothing advertised)
        self._held: OrderedDict[str, int] = OrderedDict()  # digest -> tokens it adds to its prefix
        self._tokens = 0
        self.added: set[str] = set()
        self.removed: set[str] = set()

    def add(self, chain: list[Segment]) -> None:
        # Last segment first: the chain's root (a system prompt every turn shares) ends up the most
        # recently used, so a chain loses its tail first, as the engine frees a prompt's last blocks
        # first; a tail kept without its root could never match.
        for i in reversed(range(len(chain))):
            segment = chain[i]
            if segment.digest in self._held:
                self._held.move_to_end(segment.digest)
                continue
            tokens = segment.tokens - (chain[i - 1].tokens if i else 0)
            self._held[segment.digest] = tokens
            self._tokens += tokens
            self.added.add(segment.digest)
            self.removed.discard(segment.digest)
        capacity = self.capacity()
        while self._held and self._tokens > capacity:
            digest, tokens = self._held.popitem(last=False)
            self._tokens -= tokens
            self.added.discard(digest)
            self.removed.add(digest)

    @property
    def digests(self) -> list[str]:
        return list(self._held)


@dataclass
class _Pending:
    released: list[tuple[str, str]] = field(default_factory=list)  # (tenant, request id)
    charges: list[tuple[str, float]] = field(default_factory=list)  # (service field, tokens)


class Accounting:
    """`capacity()`: tokens the engine's KV cache holds (what the advertised prefixes add up to, at
    most); `held()`: jobs the worker holds from the shared lanes (read by routers, several times a
    second)."""

    def __init__(self, redis: Redis, names: Names, consumer: str, ttl_ms: int,
                 capacity: Callable[[], int] = lambda: 0, held: Callable[[], int] = lambda: 0) -> None:
        self.redis, self.names, self.consumer, self.ttl_ms = redis, names, consumer, ttl_ms
        self.prefixes = PrefixAdvert(capacity)
        self.held = held  # jobs this worker holds from the shared lanes (its load, for routers)
        self._pending = _Pending()
        self._charge = redis.register_script(_CHARGE)
        self._rewritten = float("-inf")

    def started(self, job: Job) -> None:
        """The job entered the engine here: its prompt's KV will be in this worker's cache."""
        self.prefixes.add(prefix_chain(job_dict(job)))

    def finished(self, job: Job, tokens: int, charged_to: str, charged: float, answer: str | None) -> None:
        """The job's last event is written: release its tenant's slot, charge what it really cost."""
        if job.tenant:
            self._pending.released.append((job.tenant, job.id))
        account = job.tenant or NO_TENANT
        self._pending.charges.append((account, tokens - (charged if charged_to == account else 0.0)))
        if answer is not None:
            self.prefixes.add(answer_chain(job_dict(job), answer))

    def refund(self, account: str, charged: float) -> None:
        """A job charged when taken left this worker unserved (forwarded: affinity.py); whoever serves
        it charges it in full."""
        if charged:
            self._pending.charges.append((account, -charged))

    async def loop(self) -> None:
        while True:
            await anyio.sleep(FLUSH_S)
            try:
                await self.flush()
            except TRANSIENT as e:  # kept; the next flush sends it
                log.info("accounting flush failed (%s); retrying", e)

    async def flush(self) -> None:
        pending, self._pending = self._pending, _Pending()
        try:
            await self._write(pending)
        except BaseException:
            self._pending.released += pending.released
            self._pending.charges += pending.charges
            raise

    async def _write(self, p: _Pending) -> None:
        key = self.names.worker_prefixes(self.consumer)
        # Taken now: job tasks add to fresh sets while the round trip is out.
        added, removed = self.prefixes.added, self.prefixes.removed
        self.prefixes.added, self.prefixes.removed = set(), set()
        try:
            await self._send(p, key, added, removed)
        except BaseException:
            self.prefixes.added |= added - self.prefixes.removed
            self.prefixes.removed |= removed - self.prefixes.added
            raise

    async def _send(self, p: _Pending, key: str, added: set[str], removed: set[str]) -> None:
        names = self.names
        rewrite = time.monotonic() - self._rewritten > REWRITE_S
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(names.worker_streams, {self.consumer: int(time.time() * 1000)})
            pipe.hset(names.loads, self.consumer, self.held())
            for tenant, request_id in p.released:
                pipe.zrem(names.tenant_active(tenant), request_id)
            for account, tokens in p.charges:
                await scripts.queue(pipe, self._charge, [names.service, names.tenants], [account, tokens])
            if rewrite:
                pipe.delete(key)
                added = set(self.prefixes.digests)
            elif removed:
                pipe.srem(key, *removed)
            if added:
                pipe.sadd(key, *added)
            pipe.pexpire(key, self.ttl_ms)
            replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, NoScriptError) for r in replies):  # a fresh or restarted cluster node
            await scripts.load(self.redis, self._charge)
            await self._retry_charges(p.charges)
        if rewrite:
            self._rewritten = time.monotonic()

    async def _retry_charges(self, charges: list[tuple[str, float]]) -> None:
        for account, tokens in charges:
            await self._charge(keys=[self.names.service, self.names.tenants], args=[account, tokens])

    async def leave(self) -> None:
        """This worker stops: its prefixes are no reason to route anything here any more."""
        await self.redis.delete(self.names.worker_prefixes(self.consumer))
        await self.redis.hdel(self.names.loads, self.consumer)
