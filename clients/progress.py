"""Where a job is before its first token: its place in the queue, or how far its prompt is.

Nothing of this is an event: it is read on demand (by the gateway for `status` frames, by any
client) from what Redis already holds, and nothing in Redis is written for it but the workers'
`progress:{id}` values.

Place in the queue: SUBMIT_SCRIPT returns the stream's entries-added count right after the job's
XADD (its ordinal), and the consumer group's `entries-read` counts what the workers have read, so
`ordinal - 1 - entries-read` jobs are ahead of it (all of them still queued: the group reads in
order). An ordinal is not known on a Redis Cluster, to another gateway resuming the request, or on
Redis < 7; such a job shows as queued without a place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from clients.names import Names


@dataclass(frozen=True)
class Placement:
    """Where a job was pushed: its stream and its ordinal there (None: not known)."""

    stream: str
    ordinal: int | None = None


@dataclass(frozen=True)
class JobStatus:
    # queued: no worker has read it | starting: a worker read it (its prompt is being prepared) |
    # waiting: in a worker's engine queue | prefill: its prompt is being computed
    state: str
    position: int | None = None  # queued: jobs ahead of it, when known
    computed: int | None = None  # waiting/prefill: prompt tokens computed so far, of `total`
    total: int | None = None
    worker: str | None = None

    def describe(self) -> str:
        """One line for a person waiting on it."""
        if self.state == "queued":
            if self.position is None:
                return "queued"
            return "queued: next in line" if self.position == 0 else f"queued: {self.position} ahead"
        if self.state == "starting":
            return "a worker took it: preparing the prompt"
        return "waiting for room on the worker" if self.state == "waiting" else "processing the prompt"

    def frame(self, request_id: str) -> dict[str, Any]:
        return {"type": "status", "id": request_id,
                **{k: v for k, v in asdict(self).items() if v is not None}}


def ahead_of(ordinal: int | None, groups: Any, group: str) -> int | None:
    """Jobs ahead of the one with this ordinal (negative: the workers read it), from XINFO GROUPS."""
    if ordinal is None:
        return None
    if not isinstance(groups, list):  # no such stream yet: nothing was read
        return None
    for g in groups:
        info = {_text(k): v for k, v in g.items()} if isinstance(g, dict) else {}
        if _text(info.get("name")) == group:
            read = info.get("entries-read")
            if read is None and _text(info.get("last-delivered-id")) == "0-0":
                read = 0  # a group created at the start of the stream that has read nothing yet
            return None if read is None else ordinal - 1 - int(read)
    return ordinal - 1  # no worker ever joined: every entry before it waits too


def status_of(progress: bytes | None, ahead: int | None) -> JobStatus:
    if progress:
        p = json.loads(progress)
        return JobStatus(p["state"], computed=int(p["computed"]), total=int(p["total"]), worker=p.get("worker"))
    if ahead is not None and ahead < 0:
        return JobStatus("starting")
    return JobStatus("queued", position=ahead)


async def job_statuses(redis: Any, names: Names, jobs: dict[str, Placement | None]) -> dict[str, JobStatus]:
    """id -> where it was pushed (None: not known; its id's stream is assumed) in, id -> status out,
    in one pipelined round trip (per slot on a cluster). A place counts the jobs ahead in the job's
    own stream (its lane or tenant queue)."""
    ids = list(jobs)
    placed = {rid: jobs[rid] or Placement(names.stream_for(rid)) for rid in ids}
    streams = sorted({p.stream for p in placed.values()})
    async with redis.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.get(names.progress(rid))
        for stream in streams:
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
    progress, groups = replies[:len(ids)], dict(zip(streams, replies[len(ids):], strict=True))
    return {rid: status_of(p if isinstance(p, bytes) else None,
                           ahead_of(placed[rid].ordinal, groups[placed[rid].stream], names.group))
            for rid, p in zip(ids, progress, strict=True)}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
