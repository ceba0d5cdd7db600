"""One parsed OpenAI request -> its checked protocol v1 jobs: shared by the live endpoints (routes.py)
and the Batch API (batches.py), so a batch line becomes exactly the job the same body sent live would."""

from __future__ import annotations

from typing import Any

from clients.errors import ProtocolError
from clients.protocol import VERSION
from workers.gateway.admission import check_job
from workers.gateway.openai.jobs import GatewayServices
from workers.gateway.openai.request import OpenAIError, OpenAIRequest
from workers.gateway.tenants import job_id, tag

_STATUS = {"invalid_request": 400, "invalid_params": 400, "too_large": 413, "bad_encoding": 400,
           "unsupported_version": 400, "duplicate_id": 409, "unknown_request": 404}


def from_protocol(e: ProtocolError) -> OpenAIError:
    return OpenAIError(_STATUS.get(e.code, 400), e.message, e.param, e.code)


def build_jobs(gw: GatewayServices, req: OpenAIRequest, request_id: str, tenant: str = "",
               session: str | None = None, lora: str | None = None,
               priority: int | None = None) -> list[dict[str, Any]]:
    """One job per prompt (ids `request_id`, or `request_id.N` for several), tagged with the tenant,
    checked as every pushed job is. `priority` overrides the request's own (the batch lane's)."""
    many = len(req.prompts) > 1
    jobs = []
    limit = gw.prompt_limit()
    if req.kind == "embedding" and not gw.config.max_prompt_tokens:
        limit = gw.workers_max_model_len  # nothing is generated after an embedding's prompt: it may fill the model
    for p, prompt in enumerate(req.prompts):
        own = f"{request_id}.{p}" if many else request_id
        job = {"v": VERSION, "id": job_id(tenant, own), **prompt, "params": req.params}
        if priority is None:
            priority = req.priority
        if priority is not None:
            job["priority"] = priority
        if lora is not None:
            job["lora"] = lora
        tag(job, tenant, session)
        try:
            # Its tools and tool_choice are request.py's, parsed from the body with OpenAI's errors.
            check_job(job, gw.limits, limit, gw.workers_max_model_len, tools_parsed=True)
        except ProtocolError as e:
            raise from_protocol(e) from e
        jobs.append(job)
    return jobs
