"""What a job must pass before the gateway pushes it, on every path (/ws frames, the OpenAI API).

Everything a worker would refuse that the gateway can judge without the model (schema, nesting, text
that is not Unicode, size once encoded, sampling parameters the engine refuses) and prompts longer
than the workers can take are refused here, so a client's mistake is answered at once and never
reaches a worker. What needs the tokenizer (a text prompt's length, a token id past the vocabulary)
the worker checks: the gateway holds no model.
"""

from __future__ import annotations

import json
from typing import Any

from clients.errors import ProtocolError
from clients.protocol import Job, Limits, parse_job
from streamer.sampling_params import SamplingParams

# The most tokens a job may ask to generate: far past any model's context, yet a number every part
# (the tenants' Lua arithmetic, the engine's counters) holds exactly; 2**64 used to be pushed.
MAX_TOKENS_LIMIT = 2**31 - 1


def check_job(job: dict[str, Any], limits: Limits, prompt_limit: int, max_model_len: int = 0, *,
              tools_parsed: bool = False) -> Job:
    """The worker's own checks (all but those of `tools` and `tool_choice` when `tools_parsed`: the
    OpenAI parser built them; see parse_job), then the prompt's length (`prompt_limit` tokens; 0:
    unknown) and the job's size as the worker will read it; with `max_model_len` (the OpenAI API, as
    vLLM's), a `max_tokens` the context cannot hold beside the prompt. Raises ProtocolError naming the
    request."""
    parsed = parse_job(job, "json", limits, tools_parsed=tools_parsed)
    max_tokens = (job.get("params") or {}).get("max_tokens") if isinstance(job.get("params"), dict) else None
    if isinstance(max_tokens, int) and max_tokens > MAX_TOKENS_LIMIT:
        raise ProtocolError("invalid_params", f"`max_tokens` {max_tokens} is past the most any job may ask for "
                            f"({MAX_TOKENS_LIMIT})", parsed.id)
    ids = parsed.prompt_token_ids
    if ids is not None and prompt_limit and len(ids) > prompt_limit:
        raise ProtocolError("invalid_request", f"`prompt_token_ids` holds {len(ids)} tokens; the workers take "
                            f"at most {prompt_limit}", parsed.id)
    refusal = context_refusal(parsed, max_model_len)
    if refusal is not None:
        raise ProtocolError("invalid_request", refusal, parsed.id)
    _check_encoded(job, limits, parsed.id)
    _check_params(parsed)  # after: a number JSON cannot carry is said as such
    return parsed


def _check_params(job: Job) -> None:
    """The engine's own check of the job's sampling parameters, as the worker will make it (the
    checkpoint's defaults fill only what the job leaves out, and are valid by themselves)."""
    try:
        SamplingParams.from_dict(job.params)
    except (TypeError, ValueError) as e:
        raise ProtocolError("invalid_params", f"invalid sampling parameters: {e}", job.id,
                            getattr(e, "param", None)) from e


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


def context_refusal(job: Job, max_model_len: int) -> str | None:
    """Why the job's `max_tokens` cannot fit the model's context with its prompt, in vLLM's words (its
    OpenAI server refuses such a request with 400); None when it fits or cannot be judged here
    (`max_model_len` 0: no worker has said; no `max_tokens`: until the context is full). A text
    prompt is at least one token: only the worker's tokenizer knows more."""
    max_tokens = job.params.get("max_tokens")
    if not max_model_len or not isinstance(max_tokens, int):
        return None
    known = job.prompt_token_ids is not None
    prompt = len(job.prompt_token_ids) if job.prompt_token_ids is not None else 1
    if prompt + max_tokens <= max_model_len:
        return None
    has = f"{prompt} input tokens" if known else "at least 1 input token"
    return (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {has} ({max_tokens} > {max_model_len} - "
            f"{prompt}).")
