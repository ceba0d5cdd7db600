"""What a job must pass before the gateway pushes it, on every path (/ws frames, the OpenAI API).

Everything a worker would refuse without being able to answer (schema, nesting, text that is not
Unicode, size once encoded) and prompts longer than the workers can take are refused here, so a
client never waits for an answer that cannot come.
"""

from __future__ import annotations

import json
from typing import Any

from clients.errors import ProtocolError
from clients.protocol import Job, Limits, parse_job

# The most tokens a job may ask to generate: far past any model's context, yet a number every part
# (the tenants' Lua arithmetic, the engine's counters) holds exactly; 2**64 used to be pushed.
MAX_TOKENS_LIMIT = 2**31 - 1


def check_job(job: dict[str, Any], limits: Limits, prompt_limit: int) -> Job:
    """The worker's own checks, then the prompt's length (`prompt_limit` tokens; 0: unknown) and the
    job's size as the worker will read it. Raises ProtocolError naming the request."""
    parsed = parse_job(job, "json", limits)
    max_tokens = (job.get("params") or {}).get("max_tokens") if isinstance(job.get("params"), dict) else None
    if isinstance(max_tokens, int) and max_tokens > MAX_TOKENS_LIMIT:
        raise ProtocolError("invalid_params", f"`max_tokens` {max_tokens} is past the most any job may ask for "
                            f"({MAX_TOKENS_LIMIT})", parsed.id)
    ids = parsed.prompt_token_ids
    if ids is not None and prompt_limit and len(ids) > prompt_limit:
        raise ProtocolError("invalid_request", f"`prompt_token_ids` holds {len(ids)} tokens; the workers take "
                            f"at most {prompt_limit}", parsed.id)
    _check_encoded(job, limits, parsed.id)
    return parsed


def _check_encoded(job: dict[str, Any], limits: Limits, rid: str) -> None:
    """The job as the worker will read it: standard JSON, within the payload limit."""
    try:
        size = len(json.dumps(job, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
    except UnicodeEncodeError as e:  # parse_job refuses lone surrogates first; kept as a last guard
        raise ProtocolError("invalid_request", "every string must be valid Unicode", rid) from e
    except ValueError as e:  # a float out of JSON's range (1e999 decodes as infinity)
        raise ProtocolError("invalid_params", f"numbers must be finite: {e}", rid) from e
    if size > limits.max_payload_bytes:
        raise ProtocolError("too_large", f"the job is {size} bytes as JSON; the limit is "
                            f"{limits.max_payload_bytes}", rid)
