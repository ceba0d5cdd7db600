"""How both APIs (`/ws` frames, session.py; the OpenAI routes, openai/routes.py) turn checked jobs into
pushed ones: claim each id, admit the jobs under their tenant's limits, let the caller subscribe, push,
and on any failure give back what was taken, so a refused or failed request leaves no trace a retry
with the same id would trip over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from clients.errors import ProtocolError
from clients.progress import Placement
from workers import tracing
from workers.gateway.hub import Hub
from workers.gateway.tenants import Reservation, TenantGate


async def submit_jobs(hub: Hub, gate: TenantGate | None, tenant: str, jobs: list[dict[str, Any]],
                      prompt_limit: int, before_push: Callable[[], Awaitable[None]],
                      on_failure: Callable[[], Awaitable[None]]) -> list[Placement]:
    """Push `jobs` (one request's, checked with protocol.parse_job). `before_push` runs once every id
    is ours and admitted (subscribe there, so the first token cannot be missed); `on_failure` undoes
    what the caller did (stop watching). Raises ProtocolError `duplicate_id`, tenants.RateLimited, or
    what Redis raised; a job already pushed when a later one fails is cancelled."""
    claims: dict[str, str] = {}
    pushed: list[str] = []
    reservation: Reservation | None = None
    spans = _request_spans(jobs)
    try:
        for job in jobs:
            claim = await hub.claim(job["id"], tenant)
            if claim is None:
                raise ProtocolError("duplicate_id", f"id {job['id']!r} is already used by another request",
                                    job["id"])
            claims[job["id"]] = claim
        # After the ids are ours (a duplicate costs the tenant nothing), before anything is pushed.
        if gate is not None:
            reservation = await gate.admit(tenant, jobs, prompt_limit)
        await before_push()
        placements = []
        for job in jobs:
            placements.append(await hub.push(job, claims[job["id"]]))
            pushed.append(job["id"])
        return placements
    except BaseException:
        with contextlib.suppress(Exception):
            await on_failure()
        for rid, claim in claims.items():
            with contextlib.suppress(Exception):  # a pushed one runs for nobody: cancel it
                await (hub.cancel(rid) if rid in pushed else hub.release(rid, claim))
        if gate is not None:
            with contextlib.suppress(Exception):  # a pushed one's slot is freed by the worker that ends it
                await gate.release(reservation, [job["id"] for job in jobs if job["id"] not in pushed])
        for span in spans:
            span.set_attribute("streamer.refused", True)
        raise
    finally:
        for span in spans:
            span.end()


def _request_spans(jobs: list[dict[str, Any]]) -> list[Any]:
    """With tracing on, a `gateway.request` span per job, under the client's trace when it sent one;
    the job carries the span on (its `traceparent`), so the worker's spans are its children."""
    tracer = tracing.tracer("streamer-gateway")
    if tracer is None:
        return []
    spans = []
    for job in jobs:
        span = tracer.start_span("gateway.request", context=tracing.context_of(job.get("traceparent", "")),
                                 attributes={"streamer.request_id": job["id"]})
        job["traceparent"] = tracing.traceparent_of(span)
        spans.append(span)
    return spans
