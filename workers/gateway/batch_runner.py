"""Drives the OpenAI Batch API's batches (docs/openai.md): every gateway runs one `BatchRunner`, and
for each unfinished batch whichever gateway holds its lease (a Redis key with a TTL, renewed every
step) pushes its lines as ordinary jobs in the batch lane, a window at a time, and collects each line's
answer from its jobs' durable events streams.

Nothing here is remembered only in memory. A line's job ids follow from the batch id and the line's
place, so a push repeated after a crash is refused as a duplicate (the job runs once); a result is
written keyed by custom_id with HSETNX (batch_store.py), so it is written once; and the output files
are built from those results in input order under ids that follow from the batch id. A gateway that
dies mid-batch leaves a lease that expires, and another gateway (or the same one restarted) carries
on from Redis: no line is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from clients.backoff import TRANSIENT
from clients.errors import ProtocolError
from clients.protocol import decode_payload, split_fields
from workers.gateway.openai.batch_store import WINDOW_S, BatchStore
from workers.gateway.openai.embeddings import assembler_for
from workers.gateway.openai.file_store import RedisFileStore, StoredFile
from workers.gateway.openai.jobs import GatewayServices
from workers.gateway.openai.response import StreamMeta
from workers.gateway.submit import submit_jobs
from workers.gateway.tenants import RateLimited

log = logging.getLogger("streamer.gateway")

WINDOW = 64  # most lines of one batch pushed and not finished at a time: the queue never fills with them
# Batches together keep at most --batch-seat-share of the live workers' seats (max_num_seqs) busy: the
# rest stay free, so an interactive job starts at its next step without preempting (and recomputing)
# batch work, and steps stay nearer the size interactive traffic makes them.
SEATS_EVERY_S = 2.0  # how often the live workers' seats are read again
PERIOD_S = 0.25  # how often each held batch is advanced
LEASE_MS = 5000  # a dead gateway's batches are taken over within this
WIND_DOWN_S = 10.0  # a cancelled or expired batch waits this long for its lines' jobs to stop
_ENDED = {"cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
          "expired": ("batch_expired", "This request could not be executed before the completion window expired.")}


@dataclass
class _Held:
    """What this gateway caches about a batch whose lease it holds (all of it can be read again)."""

    lines: list[dict[str, Any]]
    done: set[str]  # custom_ids with a result
    cancels_sent: bool = False
    winding_since: float | None = None
    repushed: set[str] = field(default_factory=set)


async def _nothing() -> None:
    return None


class BatchRunner:
    def __init__(self, gw: GatewayServices) -> None:
        self.gw = gw
        self.store = BatchStore(gw.hub.redis, gw.hub.names)
        self.files = RedisFileStore(gw.hub.redis, gw.hub.names)
        self.holder = uuid.uuid4().hex  # this process, as a lease holder
        self.held: dict[str, _Held] = {}
        self._seats: tuple[float, int] = (float("-inf"), 0)  # (when read, live workers' seats)
        self.window = WINDOW  # lines each batch may keep in flight now (_window)

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except TRANSIENT as e:  # Redis away: the batches wait in it, and so do we
                log.warning("batch runner: Redis unavailable: %r", e)
                self.held.clear()
            except Exception:
                log.exception("batch runner: a step failed; retrying")
                self.held.clear()
            await asyncio.sleep(PERIOD_S)

    async def _window(self, batches: int) -> int:
        """Lines each batch may keep in flight: its part of SEAT_SHARE of the live seats."""
        when, seats = self._seats
        if time.monotonic() - when > SEATS_EVERY_S:
            workers = await self.gw.hub.workers()
            seats = sum(max(1, int(w.get("max_num_seqs") or 1)) for w in workers)
            self._seats = (time.monotonic(), seats)
        return max(1, min(WINDOW, int(seats * self.gw.config.batch_seat_share) // max(1, batches)))

    async def tick(self) -> None:
        active = await self.store.active()
        self.window = await self._window(len(active)) if active else WINDOW
        for batch_id in active:
            if await self.store.lease(batch_id, self.holder, LEASE_MS):
                await self.step(batch_id)
            else:
                self.held.pop(batch_id, None)  # another gateway drives it; our cache would go stale

    async def step(self, batch_id: str) -> None:
        state = await self.store.state(batch_id)
        if state is None or state["status"] in ("completed", "failed", "cancelled", "expired"):
            await self.store.finished(batch_id)
            self.held.pop(batch_id, None)
            return
        status, fixed = state["status"], json.loads(state["obj"])
        if status == "validating":  # checked when created (batches.py): its lines may run
            await self.store.move(batch_id, "in_progress", "validating")
            return
        h = self.held.get(batch_id)
        if h is None:
            h = self.held[batch_id] = _Held(await self.store.lines(batch_id), await self.store.done_ids(batch_id))
        ending = "cancelled" if status == "cancelling" else state.get("ending", "completed")
        pushed = int(state.get("next", 0))
        running = [i for i in range(pushed) if h.lines[i]["custom_id"] not in h.done]
        running = await self._collect(batch_id, h, running, winding=ending != "completed",
                                      tenant=fixed["tenant"])
        if status == "in_progress":
            if time.time() >= fixed["expires_at"]:
                await self.store.set(batch_id, ending="expired")
                await self.store.move(batch_id, "finalizing", "in_progress")
                return
            if pushed == len(h.lines) and not running:  # every line pushed before this step has ended
                await self.store.move(batch_id, "finalizing", "in_progress")
                return
            await self._push_more(batch_id, h, pushed, sum(len(h.lines[i]["jobs"]) for i in running), fixed["tenant"])
            return
        # cancelling, or finalizing (finished, or past its window): stop what still runs, then write.
        if running and ending != "completed":
            if not h.cancels_sent:
                h.cancels_sent, h.winding_since = True, time.monotonic()
                for i in running:
                    for job in h.lines[i]["jobs"]:
                        with contextlib.suppress(ProtocolError):  # its keys expired: nothing runs
                            await self.gw.hub.cancel(job["id"])
            assert h.winding_since is not None
            if time.monotonic() - h.winding_since < WIND_DOWN_S:
                return
        await self._finalize(batch_id, h, fixed, status, ending)

    # --- pushing -------------------------------------------------------------------------------------

    async def _push_more(self, batch_id: str, h: _Held, pushed: int, running: int, tenant: str) -> int:
        """Push lines while fewer than the window's jobs run; returns how many lines are pushed."""
        window = self.window
        limits = self.gw.config.tenants.get(tenant)
        if limits is not None and limits.max_concurrent > 0:  # half its seats stay for its live requests
            window = max(1, min(window, limits.max_concurrent // 2))
        # Counted in jobs (a completions line with several prompts is several); one line always may run.
        while pushed < len(h.lines) and (running == 0 or running + len(h.lines[pushed]["jobs"]) <= window):
            for job in h.lines[pushed]["jobs"]:
                if not await self._push(job, tenant):
                    return pushed  # the tenant is at its limit: the rest waits for the next step
            pushed, running = pushed + 1, running + len(h.lines[pushed]["jobs"])
            await self.store.set(batch_id, next=pushed)
        return pushed

    async def _push(self, job: dict[str, Any], tenant: str) -> bool:
        """Push one job; True when it is (or already was) in the queue."""
        try:
            await submit_jobs(self.gw.hub, self.gw.gate, tenant, [job], self.gw.prompt_limit(), _nothing, _nothing)
        except RateLimited:  # (a ProtocolError too)
            return False
        except ProtocolError as e:
            if e.code != "duplicate_id":  # checked when the batch was created: a limit changed since
                raise
            # Pushed before (by a gateway that died before it recorded so): it runs once.
        return True

    # --- collecting ----------------------------------------------------------------------------------

    async def _collect(self, batch_id: str, h: _Held, running: list[int], *, winding: bool,
                       tenant: str) -> list[int]:
        """Record every running line whose jobs all ended; returns the lines still running."""
        hub, names = self.gw.hub, self.gw.hub.names
        jobs = [job["id"] for i in running for job in h.lines[i]["jobs"]]
        async with hub.redis.pipeline(transaction=False) as pipe:
            for rid in jobs:
                pipe.xrevrange(names.events(rid), count=1)
                pipe.exists(names.job(rid))
            replies = await pipe.execute()
        last = {rid: (_event(replies[2 * k]), bool(replies[2 * k + 1])) for k, rid in enumerate(jobs)}
        still = []
        for i in running:
            line = h.lines[i]
            ends = [last[job["id"]][0] for job in line["jobs"]]
            if all(e is not None and e.get("type") in ("done", "error") for e in ends):
                aborted = any(e is not None and e.get("finish_reason") == "abort" for e in ends)
                if winding and aborted:  # stopped by the batch's cancel: _finalize lists it as such
                    continue
                await self._record(batch_id, h, line)
                continue
            still.append(i)
            for job in line["jobs"]:
                event, queued = last[job["id"]]
                if event is None and not queued and not winding:
                    # Neither queued nor started: its push was lost with Redis (or its keys expired).
                    log.warning("batch %s: job %s was lost; pushing it again", batch_id, job["id"])
                    await self._push(job, tenant)
        return still

    async def _record(self, batch_id: str, h: _Held, line: dict[str, Any]) -> None:
        meta = StreamMeta(**line["meta"])
        assembler = assembler_for(meta)
        for j, rid in enumerate(meta.jobs):
            for _entry, fields in await self.gw.hub.redis.xrange(self.gw.hub.names.events(rid)):
                assembler.on_event(j, decode_payload(*split_fields(fields)))
        error = assembler.error
        if error is None:
            status, body = 200, assembler.body()
        else:
            status = 500 if error["type"] == "server_error" else 504 if error["code"] == "expired" else 400
            body = {"error": error}
        out = {"id": f"batch_req_{meta.request_id}", "custom_id": line["custom_id"],
               "response": {"status_code": status, "request_id": meta.request_id, "body": body}, "error": None}
        await self.store.record(batch_id, line["custom_id"], out, failed=error is not None)
        h.done.add(line["custom_id"])

    # --- finishing -----------------------------------------------------------------------------------

    async def _finalize(self, batch_id: str, h: _Held, fixed: dict[str, Any], status: str, ending: str) -> None:
        if ending in _ENDED:  # the lines that never ran are in the error file, as OpenAI lists them
            code, message = _ENDED[ending]
            for line in h.lines:
                if line["custom_id"] not in h.done:
                    await self.store.record(batch_id, line["custom_id"], {
                        "id": f"batch_req_{line['meta']['request_id']}", "custom_id": line["custom_id"],
                        "response": None, "error": {"code": code, "message": message}}, failed=True)
        out, err = await self.store.results(batch_id)
        keep_until = int(fixed["expires_at"]) + WINDOW_S
        ids: dict[str, str] = {}
        for kind, found in (("output", out), ("error", err)):
            if not found:
                continue
            # In input order, so an interrupted batch's file equals an uninterrupted one's.
            text = "".join(found[line["custom_id"]] + "\n" for line in h.lines if line["custom_id"] in found)
            file_id = f"file-{batch_id.removeprefix('batch_')}-{kind}"
            await self.files.put(StoredFile(file_id, len(text.encode()), int(time.time()), f"{batch_id}_{kind}.jsonl",
                                            f"batch_{kind}", keep_until, fixed["tenant"]),
                                 text.encode(), only_new=True)
            ids[f"{kind}_file_id"] = file_id
        if ids:
            await self.store.set(batch_id, **ids)
        if ending == "completed" and status == "finalizing":
            await self.store.move(batch_id, "completed", "finalizing")
        else:
            await self.store.move(batch_id, ending, status)
        await self.store.finished(batch_id)
        self.held.pop(batch_id, None)
        log.info("batch %s %s: %d answered, %d failed", batch_id, ending, len(out), len(err))


def _event(reply: Any) -> dict[str, Any] | None:
    """The last event of an XREVRANGE COUNT 1 reply (None: no events yet)."""
    if not reply:
        return None
    try:
        event = decode_payload(*split_fields(reply[0][1]))
    except ProtocolError:
        return None
    return event if isinstance(event, dict) else None
