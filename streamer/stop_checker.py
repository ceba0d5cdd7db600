"""When a sequence is done, and why."""

from __future__ import annotations

from streamer.request import Sequence


def finish_reason_after(seq: Sequence, token: int, stop_str: str | None, eos_token_ids: set[int],
                        max_model_len: int) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) once `token` was appended to `seq`, or None to go on."""
    p = seq.params
    past_min = seq.num_output_tokens >= p.min_tokens
    if past_min and not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if past_min and token in p.stop_token_ids:
        return "stop", token
    if stop_str is not None:
        return "stop", stop_str
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
        return "length", None
    if seq.num_tokens >= max_model_len:
        return "length", None
    return None
