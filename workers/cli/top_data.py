"""What `streamer top` shows, read from Redis: one snapshot as a plain dict (top_view.py renders it).

One pipelined round trip per refresh, no key scan: the heartbeat set lists the workers (newest beat
first), and the stats hashes of the workers the previous refresh found are read in the same round trip.
Only when a worker joins is its hash read in a second one. A member without a hash is dead (the hash
expires 3 beats after the last one, within the heartbeat set's STALE_MS: clients/heartbeats.py).

A snapshot:

    {"redis": "redis://127.0.0.1:6379/0", "time_ms": 1767225600000, "dead": 0, "dead_stream": "llm:dead",
     "traces_stream": "llm:traces",
     "workers": [{"name", "model", "device", "running", "waiting", "jobs", "kv_blocks_used", "kv_blocks_total",
                  "kv_usage" (the share of the KV cache's blocks in use), "updated_ms",
                  "tokens_per_s" (None: not known yet)}],
     "streams": [{"name", "length", "groups": [{"name", "consumers", "pending", "lag" (None: unknown)}]}],
     "traces": [{"worker", "at_ms", "step", "total_s", "breakdown": {"schedule_s": ..., ...}}],  # newest first
     "batches": [{"id", "status", "endpoint", "total", "completed", "failed"}]}  # running (Batch API)
"""

from __future__ import annotations

import json
import time
from typing import Any

from clients.heartbeats import MAX_LISTED
from clients.protocol import Names
from clients.streams import parse_registry
from workers.gateway.openai.batch_store import active_batches_key
from workers.gateway.openai.file_store import keyed

# The heartbeat field holding the worker's cumulative count of generated tokens (tokens/s is its rate).
TOKENS_FIELD = "generation_tokens"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _number(value: Any, kind: type = int) -> Any:
    try:
        return kind(_text(value))
    except (TypeError, ValueError):
        return kind(0)


class Rates:
    """Tokens/s of each worker, from the cumulative token counter of its successive heartbeats."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # worker -> (updated_ms, tokens) of its last beat seen
        self._rate: dict[str, float] = {}

    def update(self, worker: str, updated_ms: int, tokens: int | None) -> float | None:
        """The worker's rate as of its latest beat (None until two beats are seen, or without a counter)."""
        if tokens is None:
            return None
        last = self._last.get(worker)
        if last is None or updated_ms < last[0] or tokens < last[1]:  # first beat seen, or a restart
            self._last[worker] = (updated_ms, tokens)
            self._rate.pop(worker, None)
        elif updated_ms > last[0]:  # a new beat (refreshes faster than beats see the same one again)
            self._rate[worker] = (tokens - last[1]) * 1000.0 / (updated_ms - last[0])
            self._last[worker] = (updated_ms, tokens)
        return self._rate.get(worker)


def worker_row(name: str, stats: dict[str, str], rate: float | None) -> dict[str, Any]:
    model = stats.get("served_model_name") or stats.get("model", "")
    return {"name": name, "model": model, "device": stats.get("device", ""),
            "running": _number(stats.get("running")), "waiting": _number(stats.get("waiting")),
            "jobs": _number(stats.get("jobs")), "kv_usage": _number(stats.get("kv_usage"), float),
            "kv_blocks_used": _number(stats.get("kv_blocks_used")),
            "kv_blocks_total": _number(stats.get("kv_blocks_total")),
            "updated_ms": _number(stats.get("updated_ms")), "tokens_per_s": rate}


def group_rows(reply: Any) -> list[dict[str, Any]]:
    """XINFO GROUPS of one stream (an error: the stream does not exist yet, so no group either)."""
    if not isinstance(reply, list):
        return []
    rows = []
    for group in reply:
        info = {_text(k): v for k, v in group.items()}
        lag = info.get("lag")
        rows.append({"name": _text(info.get("name", "")), "consumers": _number(info.get("consumers")),
                     "pending": _number(info.get("pending")), "lag": None if lag is None else _number(lag)})
    return rows


def trace_row(fields: dict[Any, Any]) -> dict[str, Any] | None:
    try:
        trace = json.loads(fields.get(b"json") or fields.get("json") or "")
    except (TypeError, ValueError):
        return None
    if not isinstance(trace, dict):
        return None
    breakdown = trace.get("breakdown")
    return {"worker": str(trace.get("worker", "?")), "at_ms": _number(trace.get("at_ms")),
            "step": trace.get("step"), "total_s": _number(trace.get("total_s"), float),
            "breakdown": breakdown if isinstance(breakdown, dict) else {}}


def batch_rows(batches: list[str], replies: list[Any], active: set[str]) -> list[dict[str, Any]]:
    """The Batch API's running batches: (HMGET status obj, HLEN out, HLEN err) per batch."""
    rows = []
    for k, batch_id in enumerate(batches):
        fields, completed, failed = (_check(r) for r in replies[3 * k:3 * k + 3])
        if batch_id not in active or not fields or fields[0] is None:
            continue
        fixed = json.loads(fields[1])
        rows.append({"id": batch_id, "status": _text(fields[0]), "endpoint": fixed["endpoint"],
                     "total": fixed["total"], "completed": completed, "failed": failed})
    return rows


def _check(reply: Any) -> Any:
    if isinstance(reply, Exception):
        raise reply
    return reply


def _hash(reply: Any) -> dict[Any, Any]:
    """A stats hash; a key of another type (a stray write) counts as no hash."""
    return reply if isinstance(reply, dict) else {}


class Gatherer:
    """Reads snapshots from one Redis (a sync redis-py client; a cluster client too)."""

    def __init__(self, client: Any, names: Names, redis_label: str, slow_steps: int = 5) -> None:
        self.client, self.names, self.label, self.slow_steps = client, names, redis_label, slow_steps
        self.rates = Rates()
        self._known: list[str] = []  # the heartbeat set's members at the previous refresh
        self._streams: list[str] = list(names.request_streams)  # as of the previous refresh
        self._own: set[str] = set()  # of those, the workers' own streams
        self._batches: list[str] = []  # the running batches at the previous refresh

    def _learn_streams(self, registry: list[Any], owners: list[Any]) -> None:
        own = [self.names.worker_requests(_text(w)) for w in owners]
        self._streams = [i.stream for i in parse_registry(self.names, registry)] + own
        self._own = set(own)

    def snapshot(self) -> dict[str, Any]:
        names, known = self.names, list(self._known)
        # The lanes, tenants' queues and workers' own streams (docs/scheduling.md) as of the previous
        # refresh: read again in this round trip, so one round trip per refresh still does.
        streams, own = self._streams, self._own
        pipe = self.client.pipeline(transaction=False)
        pipe.zrevrange(names.heartbeats, 0, MAX_LISTED - 1)
        for stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        pipe.xlen(names.dead)
        pipe.xrevrange(names.traces, count=self.slow_steps)
        for worker in known:
            pipe.hgetall(names.worker(worker))
        batches = list(self._batches)  # as the streams: the ones the previous refresh found
        for batch_id in batches:
            pipe.hmget(keyed(names, "batch", batch_id), "status", "obj")
            pipe.hlen(keyed(names, "batch-out", batch_id))
            pipe.hlen(keyed(names, "batch-err", batch_id))
        pipe.smembers(active_batches_key(names))
        pipe.zrange(names.streams, 0, -1, withscores=True)
        pipe.zrange(names.worker_streams, 0, -1)
        *replies, active, registry, owners = pipe.execute(raise_on_error=False)
        self._batches = sorted(_text(b) for b in _check(active))
        batch_replies = replies[len(replies) - 3 * len(batches):]
        replies = replies[:len(replies) - 3 * len(batches)]
        self._learn_streams(_check(registry), _check(owners))
        members = [_text(m) for m in _check(replies[0])]
        at = 1 + 2 * len(streams)
        stream_rows = [{"name": stream, "length": _check(replies[1 + 2 * i]),
                        "groups": group_rows(replies[2 + 2 * i])} for i, stream in enumerate(streams)]
        # A worker's own stream is shown while it holds jobs: 64 idle ones would bury the lanes.
        stream_rows = [row for row in stream_rows if row["name"] not in own or row["length"]]
        hashes = {w: _hash(h) for w, h in zip(known, replies[at + 2:], strict=True)}
        hashes.update(self._hashes([m for m in members if m not in hashes]))
        self._known = members
        workers = []
        for member in sorted(members):  # a steady order, not the order of the latest beats
            stats = {_text(k): _text(v) for k, v in (hashes.get(member) or {}).items()}
            if not stats:  # stopped beating: its hash has expired
                continue
            tokens = _number(stats[TOKENS_FIELD]) if TOKENS_FIELD in stats else None
            rate = self.rates.update(member, _number(stats.get("updated_ms")), tokens)
            workers.append(worker_row(member, stats, rate))
        traces = [row for _, fields in _check(replies[at + 1]) if (row := trace_row(fields)) is not None]
        return {"redis": self.label, "time_ms": int(time.time() * 1000), "workers": workers,
                "streams": stream_rows, "dead": _check(replies[at]), "dead_stream": names.dead,
                "traces": traces, "traces_stream": names.traces,
                "batches": batch_rows(batches, batch_replies, set(self._batches))}

    def _hashes(self, workers: list[str]) -> dict[str, Any]:
        """Stats hashes of workers that joined since the previous refresh (a second round trip)."""
        if not workers:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for worker in workers:
            pipe.hgetall(self.names.worker(worker))
        replies = pipe.execute(raise_on_error=False)
        return {w: _hash(h) for w, h in zip(workers, replies, strict=True)}
