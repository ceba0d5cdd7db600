"""The gateway's last check before a push (workers/gateway/admission.py), on its own: the prompt's length
against what the workers take, and the job's size as a worker will read it, each at its edge and with
the error (code, message, request id) the client gets. The paths that call it, /ws and the OpenAI
API, are in test_gateway_limits.py and test_openai_api.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clients.errors import ProtocolError
from clients.protocol import Limits
from workers.gateway.admission import MAX_TOKENS_LIMIT, check_job

DEFAULT = Limits()


def job(**fields: Any) -> dict[str, Any]:
    return {"v": 1, "id": "r:1", "params": {"max_tokens": 4}, **fields}


def refusal(job: dict[str, Any], limits: Limits = DEFAULT, prompt_limit: int = 0) -> ProtocolError:
    with pytest.raises(ProtocolError) as refused:
        check_job(job, limits, prompt_limit)
    return refused.value


def test_a_prompt_of_ids_up_to_the_workers_limit_passes_and_one_more_is_refused() -> None:
    at = check_job(job(prompt_token_ids=[5] * 8), Limits(), prompt_limit=8)
    assert (at.id, at.encoding, at.prompt_token_ids, at.params) == ("r:1", "json", [5] * 8, {"max_tokens": 4})
    over = refusal(job(prompt_token_ids=[5] * 9), prompt_limit=8)
    assert (over.code, over.request_id) == ("invalid_request", "r:1")
    assert over.message == "`prompt_token_ids` holds 9 tokens; the workers take at most 8"
    # 0: no worker has said yet what it takes; text prompts are measured by the worker's tokenizer.
    assert check_job(job(prompt_token_ids=[5] * 9), Limits(), prompt_limit=0).prompt_token_ids == [5] * 9
    assert check_job(job(prompt="x" * 100), Limits(), prompt_limit=8).prompt == "x" * 100


def test_the_size_as_a_worker_reads_it_is_inclusive() -> None:
    """The size is the job's compact UTF-8 JSON: non-ASCII text counts in bytes, not escapes."""
    base = job(prompt="é")
    size = len(json.dumps(base, ensure_ascii=False, separators=(",", ":")).encode())
    assert check_job(base, Limits(max_payload_bytes=size), 0).prompt == "é"
    over = refusal(base, Limits(max_payload_bytes=size - 1))
    assert (over.code, over.request_id) == ("too_large", "r:1")
    assert over.message == f"the job is {size} bytes as JSON; the limit is {size - 1}"


def test_a_number_json_cannot_carry_is_refused_naming_the_request() -> None:
    bad = refusal(job(prompt="x", params={"max_tokens": 4, "temperature": float("inf")}))
    assert (bad.code, bad.request_id) == ("invalid_params", "r:1")
    assert bad.message.startswith("numbers must be finite: ")


def test_what_the_worker_would_refuse_is_refused_first_under_the_gateways_limits() -> None:
    nothing = refusal(job())  # no prompt of any kind
    assert (nothing.code, nothing.request_id) == ("invalid_request", "r:1")
    two = job(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert check_job(two, DEFAULT, 0).messages is not None
    fewer = refusal(two, Limits(max_messages=1))  # the limits given, not the defaults
    assert (fewer.code, fewer.message) == ("invalid_request", "`messages` must be a list of 1-1 messages")


def test_max_tokens_up_to_the_limit_every_part_holds_passes_and_one_more_is_refused() -> None:
    """2**31 - 1 is the most a job may ask for (the tenants' Lua arithmetic and the engine's counters hold
    it exactly); one more is refused before anything else looks at the job, naming the request."""
    at = check_job(job(prompt="x", params={"max_tokens": MAX_TOKENS_LIMIT}), DEFAULT, 0)
    assert MAX_TOKENS_LIMIT == 2**31 - 1 and at.params == {"max_tokens": MAX_TOKENS_LIMIT}
    over = refusal(job(prompt="x", params={"max_tokens": MAX_TOKENS_LIMIT + 1}))
    assert (over.code, over.request_id) == ("invalid_params", "r:1")
    assert over.message == "`max_tokens` 2147483648 is past the most any job may ask for (2147483647)"


def test_sampling_parameters_the_engine_refuses_are_refused_here() -> None:
    """The page's `temperature: -5` used to be pushed, refused by the worker and dead-lettered."""
    cold = refusal(job(prompt="x", params={"temperature": -5}))
    assert (cold.code, cold.request_id) == ("invalid_params", "r:1")
    assert cold.message.startswith("invalid sampling parameters: ") and "temperature" in cold.message
    unknown = refusal(job(prompt="x", params={"nucleus": 0.9}))
    assert (unknown.code, unknown.message) == ("invalid_params",
                                               "invalid sampling parameters: unknown sampling parameter(s): nucleus")


def test_max_tokens_past_the_context_only_where_asked_and_at_its_edge() -> None:
    at = job(prompt_token_ids=[5] * 10, params={"max_tokens": 54})
    assert check_job(at, DEFAULT, 0, max_model_len=64).params == {"max_tokens": 54}
    # Without max_model_len (/ws jobs): no such check, the answer ends at the context (`length`).
    assert check_job(job(prompt_token_ids=[5] * 10, params={"max_tokens": 55}), DEFAULT, 0).id == "r:1"
    with pytest.raises(ProtocolError) as refused:
        check_job(job(prompt_token_ids=[5] * 10, params={"max_tokens": 55}), DEFAULT, 0, max_model_len=64)
    assert (refused.value.code, refused.value.request_id) == ("invalid_request", "r:1")
    assert "(55 > 64 - 10)" in refused.value.message
    text = job(prompt="a long text", params={"max_tokens": 63})  # at least one token: 63 fits
    assert check_job(text, DEFAULT, 0, max_model_len=64).prompt == "a long text"
    assert check_job(job(prompt="x", params={}), DEFAULT, 0, max_model_len=64).params == {}  # no bound asked
