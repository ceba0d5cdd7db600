"""When a sequence stops, and why: every rule at its exact boundary, and which rule wins a tie
(vLLM's order: EOS, then stop token ids, then stop strings, then the length limits)."""

from __future__ import annotations

import pytest

from streamer.request import Sequence
from streamer.sampling_params import SamplingParams
from streamer.stop_checker import finish_reason_after

EOS = {2, 3}
PROMPT = [10, 11, 12, 13]
MAX_LEN = 12


def after(token: int, num_outputs: int, stop_str: str | None = None, **params: object) -> tuple | None:
    """The verdict once `token` became output number `num_outputs` (so it is already appended)."""
    outputs = [20] * (num_outputs - 1) + [token]
    seq = Sequence(request_id="r", index=0, token_ids=PROMPT + outputs, num_prompt_tokens=len(PROMPT),
                   params=SamplingParams(**{"max_tokens": None, **params}))
    return finish_reason_after(seq, token, stop_str, EOS, MAX_LEN)


def test_an_ordinary_token_goes_on() -> None:
    assert after(20, 1) is None
    assert after(20, 3, max_tokens=4) is None


@pytest.mark.parametrize("eos", sorted(EOS))
def test_eos_stops_without_a_stop_reason(eos: int) -> None:
    assert after(eos, 1) == ("stop", None)


def test_eos_is_ignored_with_ignore_eos_and_before_min_tokens() -> None:
    assert after(2, 1, ignore_eos=True) is None
    assert after(2, 2, min_tokens=3) is None
    assert after(2, 3, min_tokens=3) == ("stop", None)


def test_stop_token_ids_stop_with_the_token_as_reason() -> None:
    assert after(7, 1, stop_token_ids=[7]) == ("stop", 7)
    assert after(7, 1, stop_token_ids=[8]) is None
    assert after(7, 1, stop_token_ids=[7], ignore_eos=True) == ("stop", 7)  # ignore_eos is about EOS only
    assert after(7, 2, stop_token_ids=[7], min_tokens=3) is None
    assert after(7, 3, stop_token_ids=[7], min_tokens=3) == ("stop", 7)


def test_stop_string_stops_with_the_string_as_reason() -> None:
    assert after(20, 1, stop_str="END", stop=["END"]) == ("stop", "END")


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_is_reached_exactly(max_tokens: int) -> None:
    if max_tokens > 1:
        assert after(20, max_tokens - 1, max_tokens=max_tokens) is None
    assert after(20, max_tokens, max_tokens=max_tokens) == ("length", None)


def test_max_model_len_is_reached_exactly() -> None:
    room = MAX_LEN - len(PROMPT)
    assert after(20, room - 1) is None
    assert after(20, room) == ("length", None)
    assert after(20, room, max_tokens=room + 5) == ("length", None)


def test_stopping_beats_the_length_limits_on_the_same_token() -> None:
    room = MAX_LEN - len(PROMPT)
    assert after(2, 3, max_tokens=3) == ("stop", None)
    assert after(7, room, stop_token_ids=[7]) == ("stop", 7)
    assert after(20, 3, stop_str="x", stop=["x"], max_tokens=3) == ("stop", "x")


def test_eos_beats_a_stop_token_id_and_a_stop_token_id_beats_a_stop_string() -> None:
    assert after(2, 1, stop_token_ids=[2]) == ("stop", None)
    assert after(7, 1, stop_str="x", stop=["x"], stop_token_ids=[7]) == ("stop", 7)
