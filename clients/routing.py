"""Where a job waits: its lane and tenant queue, or a worker's own stream (docs/scheduling.md).

A job goes to one worker's stream only when that worker is the better place for it and has room:
it served the job's session a moment ago (its KV is there), or its prefix cache holds a long
enough prefix of the job's prompt. Everything else waits in the shared lanes, which every worker
reads (the most urgent lane first), so an idle worker always finds work.

Prefixes are matched on text, not token ids: a submitter (any client, in any language) cuts the
job's input into segments — each chat message (and the tool definitions) as canonical JSON, a plain
prompt in 256-character chunks, token ids in 64-id chunks — and chains their hashes. Workers keep
the chains of what they served (workers/worker/accounting.py) and advertise them as a Redis set; the
router asks each live worker's set, in one pipelined round trip, how much of the job's chain it holds.
So no client needs the tokenizer, and the same conversation gives the same hashes in every language.

The decision (`choose`) is a pure function of the workers' advertised state, shared by the real
router and by the many-worker simulation (bench/routing_sim.py).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from clients.chat_messages import parse_messages
from clients.heartbeats import live_script, live_worker_stats
from clients.names import BATCH_PRIORITY, Names

TEXT_CHUNK_CHARS = 256
TOKEN_CHUNK_IDS = 64
CHARS_PER_TOKEN = 4  # the weight of text in tokens, for comparing matches
MAX_SEGMENTS = 64  # hashes sent per routed job (longer prompts are matched on their first part)
MAX_LOAD = 1.5  # a worker has room for a routed job below this many jobs per seat (see `choose`)
POLICIES = ("cache_load", "cache", "least_loaded", "random", "shared")
# Outcomes counted by the gateway's metrics and shown by `streamer top`.
# balanced: sent to a worker by load alone (the `random` and `least_loaded` baselines).
# adapter: a LoRA job sent to a worker that has its adapter loaded, with no prefix held anywhere.
OUTCOMES = ("session", "hit", "miss", "fallback", "shared", "balanced", "adapter")


@dataclass(frozen=True)
class Segment:
    digest: str  # chained: covers every segment up to this one
    tokens: int  # tokens of the prefix up to and including this segment (estimated for text)


def _chain(pieces: list[tuple[str, int]]) -> list[Segment]:
    out: list[Segment] = []
    prev, total = b"", 0
    for text, tokens in pieces[:MAX_SEGMENTS]:
        prev = hashlib.blake2b(prev + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        total += tokens
        out.append(Segment(prev.hex(), total))
    return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _text_pieces(text: str) -> list[tuple[str, int]]:
    # Only whole chunks: a partial last chunk is the part of a prompt no other prompt shares.
    n = len(text) // TEXT_CHUNK_CHARS
    return [(text[i * TEXT_CHUNK_CHARS:(i + 1) * TEXT_CHUNK_CHARS], TEXT_CHUNK_CHARS // CHARS_PER_TOKEN)
            for i in range(min(n, MAX_SEGMENTS))]


def _refused(message: str, code: str = "invalid_request") -> ValueError:
    return ValueError(message)


def _as_rendered(messages: list[Any]) -> list[Any]:
    """Messages as the worker hands them to the chat template (text parts joined, tool-call arguments
    as objects), so that a submitter and the worker serving the job hash the same text."""
    try:
        return parse_messages(messages, max(1, len(messages)), _refused)
    except (ValueError, TypeError, AttributeError):  # not a valid job: the worker refuses it anyway
        return messages


def prefix_chain(job: dict[str, Any]) -> list[Segment]:
    """The chained hashes of a job's input, segment by segment (see the module's docstring)."""
    if isinstance(job.get("messages"), list):
        pieces = [(_canonical(job["tools"]), len(_canonical(job["tools"])) // CHARS_PER_TOKEN)] \
            if job.get("tools") else []
        for message in _as_rendered(job["messages"]):
            text = _canonical(message)
            pieces.append((text, max(1, len(text) // CHARS_PER_TOKEN)))
        return _chain(pieces)
    if job.get("prompt_token_ids") is not None:
        ids = job["prompt_token_ids"]
        return _chain([(",".join(map(str, ids[i:i + TOKEN_CHUNK_IDS])), TOKEN_CHUNK_IDS)
                       for i in range(0, len(ids) - TOKEN_CHUNK_IDS + 1, TOKEN_CHUNK_IDS)])
    if isinstance(job.get("prompt"), str):
        return _chain(_text_pieces(job["prompt"]))
    return []


def answer_chain(job: dict[str, Any], answer: str) -> list[Segment]:
    """A chat job's chain extended by its answer as the assistant message a client sends back on the
    next turn: the worker's cache holds the answer's KV as well."""
    if job.get("messages") is None:
        return []
    return prefix_chain({**job, "messages": [*job["messages"], {"role": "assistant", "content": answer}]})


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one live worker."""

    name: str
    load: float  # jobs held / the most it runs at once (above 1: it queues)
    matched: int = 0  # tokens of the job's prefix its cache holds
    has_adapter: bool = False  # the job's LoRA adapter is loaded there (always False for base-model jobs)


@dataclass(frozen=True)
class Decision:
    worker: str | None  # None: the shared lanes
    outcome: str  # one of OUTCOMES


def matched_tokens(chain: list[Segment], held: list[Any]) -> int:
    """Tokens of the longest prefix of `chain` a worker holds (`held`: SMISMEMBER's 0/1 per segment)."""
    tokens = 0
    for segment, present in zip(chain, held, strict=False):
        if not int(present):
            break
        tokens = segment.tokens
    return tokens


def choose(policy: str, views: list[WorkerView], session_owner: str | None = None, *,
           min_match_tokens: int = 64, max_load: float = MAX_LOAD, rng: random.Random | None = None) -> Decision:
    """Where one job goes. A worker has room while its load is below `max_load`: above 1, routed jobs
    may queue for its seats (up to half as many again by default) rather than recompute their prefix
    elsewhere, since a freed seat there comes within one job's time. `cache_load`: the session's
    worker while it has room, else the worker with
    the most matched tokens discounted by its load (matched × (1 - load)), if that is a long enough
    prefix; otherwise the shared lanes. `cache`: the longest match, load ignored. `least_loaded` and
    `random` route every job to a worker (baselines for the simulation); `shared` never routes."""
    if policy == "shared" or not views:
        return Decision(None, "shared")
    if policy == "random":
        return Decision((rng or random).choice(views).name, "balanced")
    if policy == "least_loaded":
        return Decision(min(views, key=lambda v: (v.load, v.name)).name, "balanced")
    if policy == "cache":
        best = max(views, key=lambda v: (v.matched, -v.load))
        return Decision(best.name, "hit") if best.matched >= min_match_tokens else Decision(None, "miss")
    roomy = [v for v in views if v.load < max_load]
    if session_owner is not None and any(v.name == session_owner for v in views):
        return Decision(session_owner, "session") if any(v.name == session_owner for v in roomy) \
            else Decision(None, "fallback")
    holding = [v for v in roomy if v.matched >= min_match_tokens]
    # The adapter term: a matched prefix counts most where the job's adapter is loaded (a worker
    # without it must read the adapter and its prefix cache holds other adapters' KV).
    best = max(holding, key=lambda v: (v.has_adapter, v.matched * (1 - v.load), v.matched), default=None)
    if best is not None:
        return Decision(best.name, "hit")
    if any(v.matched >= min_match_tokens for v in views):
        return Decision(None, "fallback")  # the workers holding it are full: anyone may take it
    loaded = [v for v in roomy if v.has_adapter]
    if loaded:  # no prefix anywhere: the least loaded worker that needs no adapter load
        return Decision(min(loaded, key=lambda v: (v.load, v.name)).name, "adapter")
    return Decision(None, "miss")


@dataclass(frozen=True)
class Route:
    stream: str
    rank: int | None  # the lane's rank in the stream registry; None: a worker's own stream
    outcome: str
    worker: str | None = None


def lane_route(names: Names, job: dict[str, Any], outcome: str = "shared") -> Route:
    """The shared lane (and the tenant's queue in it) a job of this priority waits in."""
    if names.shards > 1:  # sharded streams: spread by id, no lanes (Names refuses lanes then)
        return Route(names.stream_for(job["id"]), None, outcome)
    lane, rank = names.lane_for(int(job.get("priority") or 0))
    return Route(names.tenant_stream(lane, job.get("tenant") or ""), rank, outcome)


class Router:
    """Routes jobs for one submitter (the gateway, an AsyncClient). Which workers are live and how many
    seats each has is read from their heartbeats at most every `refresh_s`. A worker's load is read
    in the same round trip as the prefix lookup: the jobs it holds from the shared lanes (`Names.loads`,
    written by every worker each 250 ms; it takes those only as its seats free up) plus the length of
    its own stream (the routed jobs it has not finished: exact at that moment, whoever routed them),
    so a burst does not all land on the one worker that looked idle."""

    def __init__(self, redis: Any, names: Names, policy: str = "cache_load", *, min_match_tokens: int = 64,
                 refresh_s: float = 0.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}")
        self.redis, self.names, self.policy = redis, names, policy
        self.min_match_tokens, self.refresh_s = min_match_tokens, refresh_s
        self._capacity: dict[str, int] = {}  # live worker -> seats (max_num_seqs)
        self._adapters: dict[str, frozenset[str]] = {}  # live worker -> LoRA adapters loaded (its heartbeat)
        self._read_at = float("-inf")
        self._live = live_script(redis)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)

    async def route(self, job: dict[str, Any]) -> Route:
        route = await self._route(job)
        self.outcomes[route.outcome] += 1
        return route

    async def _route(self, job: dict[str, Any]) -> Route:
        # Batch lines wait only in the batch lane: a worker reads its own stream before every lane,
        # so a routed batch job would run ahead of interactive ones.
        if self.policy == "shared" or self.names.shards > 1 or int(job.get("priority") or 0) >= BATCH_PRIORITY:
            return lane_route(self.names, job)
        await self._refresh()
        if len(self._capacity) < 2:  # one worker (or none): the shared lane is as good and simpler
            return lane_route(self.names, job)
        chain, session = prefix_chain(job), job.get("session") or None
        views, owner = await self._views(chain, session, job.get("lora") or None)
        decision = choose(self.policy, views, owner, min_match_tokens=self.min_match_tokens)
        if decision.worker is None:
            return lane_route(self.names, job, decision.outcome)
        return Route(self.names.worker_requests(decision.worker), None, decision.outcome, decision.worker)

    async def _views(self, chain: list[Segment], session: str | None, lora: str | None = None
                     ) -> tuple[list[WorkerView], str | None]:
        # This request's own view of the seats: a concurrent request's refresh may replace the dict
        # while this one waits on Redis (a worker that just died is then gone from the new one).
        capacity = self._capacity
        workers = sorted(capacity)
        digests = [s.digest for s in chain]
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.names.loads, workers)
            pipe.get(self.names.session(session or ""))
            for name in workers:
                pipe.xlen(self.names.worker_requests(name))
            for name in workers if digests else []:
                pipe.smismember(self.names.worker_prefixes(name), digests)
            shared_jobs, owner, *rest = await pipe.execute(raise_on_error=False)
        routed, held = rest[:len(workers)], rest[len(workers):] if digests else [[] for _ in workers]
        shared = shared_jobs if isinstance(shared_jobs, list) else [None] * len(workers)
        adapters = self._adapters
        views = [WorkerView(name, (_count(s) + _count(r)) / capacity[name],
                            matched_tokens(chain, h) if isinstance(h, list) else 0,
                            lora is not None and lora in adapters.get(name, ()))
                 for name, s, r, h in zip(workers, shared, routed, held, strict=True)]
        return views, _text(owner) if session else None

    async def _refresh(self) -> None:
        if time.monotonic() - self._read_at < self.refresh_s:
            return
        # A draining worker (SIGTERM) reads no more jobs: nothing is routed to it.
        stats = [w for w in await live_worker_stats(self.redis, self.names, self._live) if w.get("draining") != "1"]
        self._capacity = {w["name"]: max(1, int(w.get("max_num_seqs") or 1)) for w in stats}
        self._adapters = {w["name"]: frozenset(filter(None, str(w.get("loras") or "").split(","))) for w in stats}
        self._read_at = time.monotonic()


def _count(value: Any) -> int:
    """A count as Redis returned it (bytes or int; None or an error: nothing known, 0)."""
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, Exception):
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
