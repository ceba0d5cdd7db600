"""Stored responses in Redis (the Responses API, docs/openai.md#responses-api), so any gateway answers
for any response, after any restart.

Per response, `response:{id}` (a hash): `obj` (the response object's fixed fields, as JSON), `job`
(its job's id in Redis), `tenant`, `session` (the conversation's, inherited by its follow-ups), `items`
(the conversation's input items up to this response, for `previous_response_id`), `cancelled` (set by
a cancel), and `final` (the finished response object, written once with HSETNX: it is a function of
the job's events, so whoever writes it first writes what anyone would). The set `responses:active`
holds the responses not finished yet; every gateway's `ResponseSweeper` writes the `final` of each
whose job ended, so a background response nobody reads keeps its output after its job's events expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from clients.backoff import TRANSIENT
from clients.errors import ProtocolError
from clients.protocol import decode_payload, split_fields
from workers.gateway.hub import Hub
from workers.gateway.openai.file_store import keyed
from workers.gateway.openai.response_events import ResponseEvents

log = logging.getLogger("streamer.gateway")

KEEP_S = 30 * 24 * 3600  # how long a stored response is kept (OpenAI keeps them 30 days)
SWEEP_EVERY_S = 0.5
REPLAYS_KEPT = 1024  # running responses whose replay a gateway keeps between reads (least recent dropped)
# KEYS[1] = the response; ARGV[1] = its final object. Written once, and never into a response deleted
# meanwhile (HSETNX alone would make a new hash of it, kept forever); returns the final one stored.
_FINISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSETNX', KEYS[1], 'final', ARGV[1])
end
return redis.call('HGET', KEYS[1], 'final')
"""


@dataclass
class _Replay:
    """A running response's job events replayed so far (ResponseStore.current)."""

    events: ResponseEvents
    last_entry: str = "0-0"  # the last events-stream entry applied ("0-0": none)
    applied: int = 0  # how many entries were applied


def _entry_order(entry: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(entry).partition("-")
    return int(ms), int(seq)


@dataclass
class StoredResponse:
    id: str
    fixed: dict[str, Any]  # the response object's fixed fields (id included)
    job: str
    tenant: str
    session: str
    items: list[dict[str, Any]]
    cancelled: bool = False
    final: dict[str, Any] | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ResponseStore:
    def __init__(self, hub: Hub) -> None:
        self.hub, self.redis, self.names = hub, hub.redis, hub.names
        self._finish = self.redis.register_script(_FINISH)
        self._replays: OrderedDict[str, _Replay] = OrderedDict()  # running responses' replays, by id

    def key(self, response_id: str) -> str:
        return keyed(self.names, "response", response_id)

    @property
    def active_key(self) -> str:
        return f"{self.names.shared}:responses:active"

    async def create(self, r: StoredResponse) -> None:
        fields = {"obj": json.dumps(r.fixed), "job": r.job, "tenant": r.tenant, "session": r.session,
                  "items": json.dumps(r.items)}
        async with self.redis.pipeline(transaction=not self.names.cluster) as pipe:
            pipe.hset(self.key(r.id), mapping=fields)
            pipe.expire(self.key(r.id), KEEP_S)
            await pipe.execute()

    async def activate(self, response_id: str) -> None:
        """Its job is pushed: the sweepers watch it from now on (before, no job is not a lost job)."""
        await self.redis.sadd(self.active_key, response_id)

    async def load(self, response_id: str) -> StoredResponse | None:
        raw = await self.redis.hgetall(self.key(response_id))
        if not raw or b"obj" not in raw:
            return None
        state = {_text(k): _text(v) for k, v in raw.items()}
        return StoredResponse(response_id, json.loads(state["obj"]), state["job"], state["tenant"], state["session"],
                              json.loads(state["items"]), "cancelled" in state,
                              json.loads(state["final"]) if "final" in state else None)

    async def delete(self, response_id: str) -> None:
        self._replays.pop(response_id, None)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.key(response_id))
            pipe.srem(self.active_key, response_id)
            await pipe.execute()

    async def mark_cancelled(self, response_id: str) -> None:
        await self.redis.hset(self.key(response_id), "cancelled", 1)

    async def current(self, r: StoredResponse) -> dict[str, Any]:
        """The response object now: the stored final one, or the job's events so far replayed (and, when
        they end it, stored as the final one). A running response's replay is kept between calls, so a
        client polling it costs the events written since its last poll, not all of them again."""
        if r.final is not None:
            return r.final
        replay = await self._replayed(r)
        if not replay.events.finished and not await self.hub.known(r.job):
            # No events and no job: its keys expired (or the push was lost with Redis) before it ended.
            replay.events.on_event({"type": "error", "code": "expired", "message": "the response's job is gone "
                                    "(expired, or lost) before it finished"})
        if replay.events.finished:
            self._replays.pop(r.id, None)
            return await self.finish(r, replay.events.snapshot())
        obj = replay.events.snapshot()
        if r.cancelled:  # its job is being stopped: it ends cancelled
            obj["status"] = "cancelled"
        return obj

    async def _replayed(self, r: StoredResponse) -> _Replay:
        """The response's replay with every job event in Redis applied: the kept one, fed what was
        written after the last entry it saw, or a new one from the first event."""
        replay = self._replays.get(r.id)
        if replay is None:
            replay = self._replays[r.id] = _Replay(ResponseEvents(r.fixed))
            replay.events.opening()
            while len(self._replays) > REPLAYS_KEPT:  # the least recently read go first
                self._replays.popitem(last=False)
        self._replays.move_to_end(r.id)
        key = self.names.events(r.job)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(key)
            pipe.xrange(key, f"({replay.last_entry}")
            length, entries = await pipe.execute()
        if length < replay.applied:  # fewer events than it saw: lost with Redis; replay what is there
            if self._replays.get(r.id) is replay:
                del self._replays[r.id]
            return await self._replayed(r)
        for entry, fields in entries:
            if _entry_order(entry) <= _entry_order(replay.last_entry):
                continue  # another read of this response applied it while this one waited for Redis
            try:
                event = decode_payload(*split_fields(fields))
            except ProtocolError as e:  # ends the response failed, as the OpenAI streams report it
                event = {"type": "error", "code": "damaged_events", "message": e.message}
            replay.events.on_event(event)
            replay.last_entry, replay.applied = _text(entry), replay.applied + 1
        return replay

    async def finish(self, r: StoredResponse, obj: dict[str, Any]) -> dict[str, Any]:
        """Store the finished object (once: the first writer's stays) and take it off the active set."""
        stored = await self._finish(keys=[self.key(r.id)], args=[json.dumps(obj)])
        await self.redis.srem(self.active_key, r.id)
        r.final = json.loads(stored) if stored is not None else obj
        return r.final

    async def cancel_job(self, r: StoredResponse) -> None:
        with contextlib.suppress(ProtocolError):  # its keys expired: nothing runs
            await self.hub.cancel(r.job)


class ResponseSweeper:
    """Every gateway runs one: it stores the final object of every response whose job has ended."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except TRANSIENT as e:  # Redis away: the responses wait in it, and so do we
                log.warning("responses sweeper: Redis unavailable: %r", e)
            except Exception:
                log.exception("responses sweeper: a sweep failed; retrying")
            await asyncio.sleep(SWEEP_EVERY_S)

    async def sweep(self) -> None:
        store = self.store
        ids = sorted(_text(i) for i in await store.redis.smembers(store.active_key))
        if not ids:
            return
        async with store.redis.pipeline(transaction=False) as pipe:
            for response_id in ids:
                pipe.hget(store.key(response_id), "job")
            jobs = await pipe.execute()
        async with store.redis.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.xrevrange(store.names.events(_text(job or b"")), count=1)
            lasts = await pipe.execute()
        for response_id, job, last in zip(ids, jobs, lasts):
            if job is None:  # deleted, or expired
                await store.redis.srem(store.active_key, response_id)
                continue
            ended = bool(last) and _ends(last[0][1])
            if ended or not await store.hub.known(_text(job)):
                r = await store.load(response_id)
                if r is not None:
                    await store.current(r)


def _ends(fields: Any) -> bool:
    try:
        event = decode_payload(*split_fields(fields))
    except ProtocolError:
        return True  # a damaged last event: replaying it ends the response failed
    return isinstance(event, dict) and event.get("type") in ("done", "error")
