"""Job intake of the Redis worker: reading the consumer group as capacity allows, then claiming each
entry's request id and reading its resume state before one task per job starts.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import anyio
from redis.exceptions import ResponseError

from workers.backoff import TRANSIENT, Backoff
from workers.protocol import ProtocolError, decode_job
from workers.resume import resume_state
from workers.worker_job import JobRunner
from workers.worker_state import Delivery, as_str

log = logging.getLogger("streamer.worker")


class Intake(JobRunner):
    """Reads entries while the engine has room and starts a `JobRunner` task for each."""

    async def _ensure_group(self) -> None:
        backoff = Backoff("create group", log)
        while True:
            try:
                # From id 0: jobs pushed before the first worker ever started are served too.
                await self.redis.xgroup_create(self.names.requests, self.names.group, id="0", mkstream=True)
                return
            except ResponseError as e:
                if "BUSYGROUP" in str(e):
                    return
                raise
            except TRANSIENT as e:
                await backoff.sleep(e)

    async def _read_loop(self) -> None:
        backoff = Backoff("read", log)
        while True:
            count = await self._wait_capacity()
            try:
                entries = await self._read(count, self.cfg.block_ms)
                backoff.reset()
            except ResponseError as e:
                await self._refused("read", e, backoff)
                continue
            except TRANSIENT as e:
                await backoff.sleep(e)
                continue
            if 0 < len(entries) < count and self.cfg.read_linger_ms > 0:
                # Jobs pushed in a burst arrive over a few ms: gather them so they enter the engine
                # together (one prefill batch) instead of one step apart.
                await anyio.sleep(self.cfg.read_linger_ms / 1000)
                with contextlib.suppress(*TRANSIENT):
                    entries += await self._read(count - len(entries), None)
            await self._start_batch([(entry_id, fields, 1) for entry_id, fields in entries])

    async def _read(self, count: int, block_ms: int | None) -> list[tuple[Any, Any]]:
        reply = await self.redis.xreadgroup(self.names.group, self.cfg.consumer, {self.names.requests: ">"},
                                            count=count, block=block_ms)
        return [entry for _stream, entries in reply or [] for entry in entries]

    async def _refused(self, what: str, error: ResponseError, backoff: Backoff) -> None:
        """Redis answered with an error: a lost group is recreated; anything else (out of memory, a
        key of the wrong type) is logged and retried with backoff, the worker stays up."""
        if "NOGROUP" in str(error):
            log.warning("consumer group missing (Redis lost its data?): creating it again")
            await self._ensure_group()
        else:
            log.error("%s: Redis refused: %s", what, error)
            await backoff.sleep(error)

    async def _start_batch(self, entries: list[tuple[Any, Any, int]]) -> None:
        """Decode a batch of entries, claim their ids in entry order (the first of two jobs with the
        same id wins), read their resume state in one round trip, then start one task per job."""
        batch = []
        for entry_id, fields, deliveries in entries:
            d = Delivery(as_str(entry_id), fields, deliveries)
            try:
                d.job = decode_job(fields or {}, self.cfg.limits)
            except ProtocolError as e:
                d.error = e
            batch.append(d)
        with_ids = [d for d in batch if d.request_id is not None]
        if with_ids:
            replies = await self._retry("load jobs", self._load_pipeline, with_ids)
            for i, d in enumerate(with_ids):
                _, owner, events, cancelled = replies[4 * i: 4 * i + 4]
                try:
                    for reply in (owner, events, cancelled):
                        if isinstance(reply, Exception):  # e.g. WRONGTYPE: a key of ours holds something else
                            raise ValueError(str(reply))
                    d.ours, d.cancelled = as_str(owner) == d.entry_id, bool(cancelled)
                    d.state = resume_state(events)
                except (ValueError, KeyError, TypeError) as e:  # someone else wrote there: stay out of it
                    d.job, d.error = None, ProtocolError("damaged_events", f"keys of {d.request_id!r}: {e}")
        for d in batch:
            self._starting += 1
            self._jobs_idle = anyio.Event() if self._jobs_idle.is_set() else self._jobs_idle
            self._pending_entries[d.entry_id] = d.request_id or ""
            self._jobs.start_soon(self._job_task, d, name=f"job {d.entry_id}")

    async def _load_pipeline(self, batch: list[Delivery]) -> list[Any]:
        ttl = int(self.cfg.events_ttl_s * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in batch:
                request_id = d.request_id or ""
                pipe.set(self.names.job(request_id), d.entry_id, nx=True, px=ttl)
                pipe.get(self.names.job(request_id))
                pipe.xrange(self.names.events(request_id))
                pipe.exists(self.names.cancelled(request_id))
            return await pipe.execute(raise_on_error=False)
