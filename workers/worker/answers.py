"""How the Redis worker answers a job: events queued for the writer, error events, dead letters, acks.

A job is answered through the event writer (event_writer.py), whose final write also acks its entry;
a job that cannot be answered in its own stream is only dead-lettered and acked here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.asyncio import Redis

from clients.backoff import TRANSIENT, retry
from clients.errors import ProtocolError
from clients.protocol import Job, error_event
from workers.worker.config import WorkerConfig
from workers.worker.event_writer import EventWriter, Write
from workers.worker.state import Delivery, RunningJob, WorkerState, as_str

log = logging.getLogger("streamer.worker")
_DEAD_PAYLOAD_BYTES = 64 * 1024


class Answers:
    """Every outcome of a job (tokens, done, error, duplicate, cancel) reaches Redis through these."""

    def __init__(self, redis: Redis, config: WorkerConfig, state: WorkerState, writer: EventWriter) -> None:
        self.redis, self.names, self.consumer = redis, config.names, config.consumer
        self.state, self.writer = state, writer

    def emit(self, run: RunningJob, events: list[dict], error: ProtocolError | None = None,
             final: bool = True) -> None:
        """Queue events for the writer; with `final`, the job's entry is acked once they are in Redis."""
        if error is not None:
            events = [*events, error_event(run.job.id, run.next_seq + len(events), error.code, error.message)]
        run.next_seq += len(events)
        entry = run.entry_id
        self.writer.put(Write(run.job.id, run.job.encoding, events, ack_entry=entry if final else None,
                              on_written=(lambda: self.state.release_entry(entry)) if final else None,
                              epoch=run.epoch))

    async def fail(self, run: RunningJob, code: str, message: str) -> None:
        """Answer a job we own with an error event and keep it in the dead letters."""
        error = ProtocolError(code, message[:300], run.job.id)
        log.info("request %s (entry %s): %s: %s", run.job.id, run.entry_id, code, error.message)
        await self.dead_letter(run.entry_id, run.fields, error)
        self.emit(run, [], error=error)

    async def reject(self, d: Delivery, error: ProtocolError) -> None:
        """A job that failed decoding or validation: dead letter, and an error event when it has an id."""
        log.info("rejected entry %s (request %s): %s %s", d.entry_id, error.request_id, error.code,
                 error.message)
        await self.dead_letter(d.entry_id, d.fields, error)
        if error.request_id is None or not d.ours or d.state.finished:
            await self.ack(d.entry_id)  # never write into another request's stream
            return
        job = Job(id=error.request_id, encoding=_encoding_of(d.fields))
        self.emit(RunningJob(job, d.entry_id, d.state.next_seq, d.fields, epoch=d.epoch), [], error=error)

    async def finish_with_error(self, d: Delivery, code: str, message: str) -> None:
        run = self.state.running.get(d.request_id or "")
        if run is None or run.entry_id != d.entry_id:
            await self.reject(d, ProtocolError(code, message[:300], d.request_id))
        else:
            await self.fail(run, code, message)

    async def dead_letter(self, entry_id: str, fields: Any, error: ProtocolError) -> None:
        entry: dict[str, Any] = {"reason": error.code, "message": error.message, "entry": entry_id,
                                 "worker": self.consumer, "time_ms": int(time.time() * 1000)}
        if error.request_id is not None:
            entry["id"] = error.request_id
        for key, value in (fields or {}).items():
            # Keep enough to diagnose; an oversized payload is not copied whole.
            entry[f"payload_{as_str(key)}"] = value[:_DEAD_PAYLOAD_BYTES]
            if len(value) > _DEAD_PAYLOAD_BYTES:
                entry["payload_bytes"] = len(value)
        await retry("dead letter", log, lambda: self.redis.xadd(self.names.dead, entry, maxlen=100_000,
                                                                approximate=True))

    async def ack(self, entry_id: str) -> None:
        async def ack() -> None:  # a fresh pipeline per attempt: a failed execute empties it
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(self.names.requests, self.names.group, entry_id)
                pipe.xdel(self.names.requests, entry_id)
                for reply in await pipe.execute(raise_on_error=False):
                    if isinstance(reply, TRANSIENT):
                        raise reply
                    if isinstance(reply, Exception):  # e.g. NOGROUP: nothing left to ack
                        log.warning("ack of entry %s refused: %s", entry_id, reply)

        await retry("ack", log, ack)
        self.state.release_entry(entry_id)


def _encoding_of(fields: Any) -> str:
    keys = {as_str(k) for k in (fields or {})}
    return "msgpack" if "msgpack" in keys and "json" not in keys else "json"
