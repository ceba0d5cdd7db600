"""Hypothesis strategies for the fuzz tests (test_fuzz_redis.py, test_fuzz_gateway.py): job maps that are
almost right, with every field drawn from values that are right, wrong in type, out of range, nested
too deeply, not valid Unicode or not JSON at all, plus byte-level damage to their encodings.

The request id is never drawn: each example gets a fresh one, so that whatever the worker or the gateway
answers can be attributed, and its absence noticed."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# A lone surrogate: what `"\ud800"` in JSON becomes, or bytes that are not UTF-8 read with surrogateescape.
SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
TEXT = st.one_of(st.text(max_size=20), SURROGATES, st.just(""))
BIG_INTS = st.sampled_from([2**31, 2**63, 2**64, -(2**64), 10**30, 10**400])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), BIG_INTS, st.floats(allow_nan=True), TEXT)


def nested(depth: int, leaf: Any = 1) -> Any:
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"k": out}
    return out


DEEP = st.integers(4, 12).map(nested)
ANY = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(TEXT, SCALARS, max_size=3), DEEP)

# Sampling parameters: small valid values (a valid job must finish quickly on the tiny model), wrong
# types, out-of-range numbers, unknown names.
PARAM_VALUES = {
    "max_tokens": st.one_of(st.integers(-2, 3), BIG_INTS, TEXT, st.floats(allow_nan=True)),
    "temperature": st.one_of(st.floats(-1, 2), st.floats(allow_nan=True), TEXT),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.just(float("nan"))),
    "top_k": st.one_of(st.integers(-3, 5), BIG_INTS),
    "n": st.one_of(st.integers(-1, 3), st.just(65), BIG_INTS),
    "seed": st.one_of(st.integers(-3, 3), BIG_INTS, TEXT),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), st.integers()),
    "stop_token_ids": st.one_of(st.lists(st.one_of(st.integers(-3, 600), BIG_INTS), max_size=3), TEXT),
    "min_tokens": st.one_of(st.integers(-1, 3), BIG_INTS),
    "logprobs": st.one_of(st.integers(-1, 3), BIG_INTS),
    "use_beam_search": st.booleans(),
    "beam_width": st.one_of(st.integers(-1, 3), BIG_INTS),
    "repetition_penalty": st.one_of(st.floats(-1, 3), st.just(float("inf"))),
    "ignore_eos": SCALARS,
}
PARAMS = st.one_of(
    st.fixed_dictionaries({}, optional=PARAM_VALUES).map(lambda p: {"max_tokens": 2, **p}),
    st.dictionaries(TEXT, ANY, max_size=3),  # unknown names
    ANY,  # not a map at all
)
PROMPTS = st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=20), SURROGATES, ANY)}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(
        st.lists(st.one_of(st.integers(0, 520), st.integers(-2, -1), BIG_INTS), max_size=5), ANY)}),
    st.fixed_dictionaries({"messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": TEXT, "content": TEXT}), min_size=1, max_size=2), ANY)}),
    st.just({}),  # no prompt
    st.fixed_dictionaries({"prompt": st.just("two"), "prompt_token_ids": st.just([1])}),
)
OPTIONAL = {"priority": st.one_of(st.integers(-3, 3), BIG_INTS, TEXT), "deadline": st.one_of(st.none(), BIG_INTS,
                                                                                              st.integers(-1, 1)),
            "v": st.one_of(st.just(1), st.just(2), st.just(True), TEXT), "extra": ANY, "\udc80": ANY}


VALID_PARAMS = st.fixed_dictionaries({"max_tokens": st.integers(1, 3)}, optional={
    "temperature": st.sampled_from([0.0, 0.7]), "top_k": st.integers(1, 5), "seed": st.integers(0, 9),
    "n": st.integers(1, 2), "stop": st.lists(st.text(max_size=3), max_size=2), "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 2)})


@st.composite
def jobs(draw: Any) -> dict[str, Any]:
    """A job map without its id (the test adds a fresh one): valid, or with a few things wrong."""
    job: dict[str, Any] = {"v": 1, "prompt": "Hello", "params": draw(VALID_PARAMS)}
    wrong = draw(st.sets(st.sampled_from(["prompt", "params", "param", "optional"]), max_size=2))
    if "prompt" in wrong:
        del job["prompt"]
        job.update(draw(PROMPTS))
    if "params" in wrong:
        job["params"] = draw(PARAMS)
    elif "param" in wrong:  # one bad value among good ones
        name = draw(st.sampled_from(sorted(PARAM_VALUES)))
        job["params"] = {**job["params"], name: draw(PARAM_VALUES[name])}
    if "optional" in wrong:
        job.update(draw(st.fixed_dictionaries({}, optional=OPTIONAL)))
    return job


@st.composite
def damage(draw: Any, data: bytes) -> bytes:
    """Byte-level damage to an encoded payload: cut, overwritten or spliced bytes."""
    if not data:
        return data
    kind = draw(st.sampled_from(["cut", "flip", "insert"]))
    at = draw(st.integers(0, len(data) - 1))
    if kind == "cut":
        return data[:at]
    if kind == "flip":
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
