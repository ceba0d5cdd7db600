"""How the Redis worker answers a job: events queued for the writer, error events, dead letters, acks.

A job is answered through the event writer (event_writer.py), whose final write also acks its entry;
a job that cannot be answered in its own stream is only dead-lettered and acked here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from clients.backoff import TRANSIENT, retry
from clients.errors import ProtocolError
from clients.events import error_event
from clients.protocol import Job
from workers.worker.config import WorkerConfig
from workers.worker.event_writer import EventWriter, Write
from workers.worker.state import Delivery, RunningJob, WorkerState, as_str

log = logging.getLogger("streamer.worker")
# A dead letter's bounded parts besides the payload prefix (--dead-payload-bytes): the message, and the
# entry's fields (a valid entry has one; a hand-written one may have thousands, with long names).
DEAD_MESSAGE_CHARS = 1024
DEAD_PAYLOAD_FIELDS = 4
DEAD_FIELD_NAME_CHARS = 64
# The client's own mistakes: a job refused with one of these in its own stream has its answer, and
# there is nothing for an operator to serve again, so it is acked without a dead letter (the dead
# letters are for jobs no worker could serve: unreadable, no id to answer, failed, a duplicate).
CLIENT_FAULTS = frozenset({"invalid_request", "invalid_params", "unsupported_version", "too_large"})


class Answers:
    """Every outcome of a job (tokens, done, error, duplicate, cancel) reaches Redis through these.
    `on_dead_letter(reason)` is called once Redis holds a dead letter (metrics)."""

    def __init__(self, redis: Redis, config: WorkerConfig, state: WorkerState, writer: EventWriter,
                 on_dead_letter: Callable[[str], None] = lambda reason: None) -> None:
        self.redis, self.names, self.consumer, self.cfg = redis, config.names, config.consumer, config
        self.state, self.writer, self.on_dead_letter = state, writer, on_dead_letter

    def emit(self, run: RunningJob, events: list[dict], error: ProtocolError | None = None,
             final: bool = True) -> None:
        """Queue events for the writer; with `final`, the job's entry is acked once they are in Redis."""
        if error is not None:
            events = [*events, error_event(run.job.id, run.next_seq + len(events), error.code, error.message)]
        run.next_seq += len(events)
        stream, entry = run.stream, run.entry_id
        on_written = None
        if final:
            traced = run.trace.final_write()

            def on_written() -> None:
                self.state.release_entry(stream, entry)
                if traced is not None:
                    traced()

        self.writer.put(Write(run.job.id, run.job.encoding, events, ack_entry=entry if final else None,
                              ack_stream=stream, on_written=on_written, epoch=run.epoch))

    async def fail(self, run: RunningJob, code: str, message: str) -> None:
        """Answer a job we own with an error event, and keep it in the dead letters unless the error
        is the client's own mistake."""
        error = ProtocolError(code, message[:300], run.job.id)
        run.trace.failed(code)
        log.info("request %s (entry %s): %s: %s", run.job.id, run.entry_id, code, error.message)
        if code not in CLIENT_FAULTS:
            await self.dead_letter(run.entry_id, run.fields, error)
        self.emit(run, [], error=error)

    async def reject(self, d: Delivery, error: ProtocolError) -> None:
        """A job that failed decoding or validation: an error event when it has an id we own, a dead
        letter when it has none or the error is not the client's own mistake."""
        log.info("rejected entry %s (request %s): %s %s", d.entry_id, error.request_id, error.code,
                 error.message)
        if error.request_id is None or not d.ours or d.state.finished:
            await self.dead_letter(d.entry_id, d.fields, error)
            await self.ack(d.stream, d.entry_id)  # never write into another request's stream
            return
        if error.code not in CLIENT_FAULTS:
            await self.dead_letter(d.entry_id, d.fields, error)
        job = Job(id=error.request_id, encoding=_encoding_of(d.fields))
        self.emit(RunningJob(job, d.entry_id, d.state.next_seq, d.fields, stream=d.stream, epoch=d.epoch), [],
                  error=error)

    async def finish_with_error(self, d: Delivery, code: str, message: str) -> None:
        run = self.state.running.get(d.request_id or "")
        if run is None or run.entry_id != d.entry_id:
            await self.reject(d, ProtocolError(code, message[:300], d.request_id))
        else:
            await self.fail(run, code, message)

    async def dead_letter(self, entry_id: str, fields: Any, error: ProtocolError) -> None:
        """Keep a job that could not be served, bounded: the reason, and at most `dead_payload_bytes` of
        its payload (`payload_bytes` gives the whole size when some was left out). The stream is trimmed
        by age (`dead_max_age_s`) and by count (`dead_max_len`) on every write."""
        entry: dict[str, Any] = {"reason": error.code, "message": error.message[:DEAD_MESSAGE_CHARS],
                                 "entry": entry_id, "worker": self.consumer, "time_ms": int(time.time() * 1000)}
        if error.request_id is not None:
            entry["id"] = error.request_id
        entry.update(dead_payload(fields or {}, self.cfg.dead_payload_bytes))
        min_id = f"{max(0, entry['time_ms'] - int(self.cfg.dead_max_age_s * 1000))}-0"

        async def write() -> None:  # a fresh pipeline per attempt: a failed execute empties it
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.names.dead, entry, maxlen=self.cfg.dead_max_len, approximate=True)
                pipe.xtrim(self.names.dead, minid=min_id, approximate=True)
                await pipe.execute()

        await retry("dead letter", log, write)
        self.on_dead_letter(error.code)

    async def ack(self, stream: str, entry_id: str) -> None:
        async def ack() -> None:  # a fresh pipeline per attempt: a failed execute empties it
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, self.names.group, entry_id)
                pipe.xdel(stream, entry_id)
                for reply in await pipe.execute(raise_on_error=False):
                    if isinstance(reply, TRANSIENT):
                        raise reply
                    if isinstance(reply, Exception):  # e.g. NOGROUP: nothing left to ack
                        log.warning("ack of entry %s refused: %s", entry_id, reply)

        await retry("ack", log, ack)
        self.state.release_entry(stream, entry_id)


def _encoding_of(fields: Any) -> str:
    keys = {as_str(k) for k in (fields or {})}
    return "msgpack" if "msgpack" in keys and "json" not in keys else "json"


def dead_payload(fields: dict[Any, Any], limit: int) -> dict[str, Any]:
    """The `payload_<field>` fields of a dead letter: the entry's fields, values cut so that together
    they hold at most `limit` bytes, at most DEAD_PAYLOAD_FIELDS of them; `payload_bytes` (the size of
    all values) is added when anything was left out, which is how a reader tells a whole payload."""
    kept: dict[str, Any] = {}
    budget, total = max(0, limit), 0
    for i, (key, value) in enumerate(fields.items()):
        raw = value if isinstance(value, bytes) else str(value).encode()
        total += len(raw)
        if i < DEAD_PAYLOAD_FIELDS:
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            kept[f"payload_{name[:DEAD_FIELD_NAME_CHARS]}"] = raw[:budget]
            budget -= len(raw[:budget])
    if sum(len(v) for v in kept.values()) < total or len(kept) < len(fields):
        kept["payload_bytes"] = total
    return kept
