"""Wire format (clients/protocol.py): decoding of untrusted jobs, event ids, resume folding."""

import json
import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.errors import ProtocolError
from clients.events import done_event, error_event, token_event
from clients.protocol import (
    Limits,
    Names,
    decode_event,
    decode_job,
    decode_message,
    encode,
    encode_job,
    event_stream_id,
    parse_job,
    readable_id,
    seq_of_stream_id,
)
from clients.resume import resume_state


def job_fields(obj, encoding="json"):
    return {encoding.encode(): encode(obj, encoding)}


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_valid_job_roundtrip(encoding):
    fields = encode_job({"id": "a1", "prompt": "Hello", "params": {"max_tokens": 4}, "priority": 2,
                         "deadline": 123}, encoding)
    job = decode_job({k.encode(): v for k, v in fields.items()})
    assert (job.id, job.encoding, job.prompt, job.params, job.priority, job.deadline) == \
        ("a1", encoding, "Hello", {"max_tokens": 4}, 2, 123)


def test_redis_cli_text_is_accepted():
    # What `redis-cli XADD llm:requests '*' json '{...}'` stores: a str field, a str payload.
    job = decode_job({"json": '{"v":1,"id":"a1","prompt":"Hello","params":{"max_tokens":16}}'})
    assert job.prompt == "Hello" and job.params == {"max_tokens": 16}


@pytest.mark.parametrize("obj, code, has_id", [
    ({"v": 1, "id": "x", "prompt": "hi", "extra": 1}, "invalid_request", True),  # unknown field
    ({"v": 2, "id": "x", "prompt": "hi"}, "unsupported_version", True),
    ({"v": 1, "id": "x"}, "invalid_request", True),  # no prompt
    ({"v": 1, "id": "x", "prompt": "hi", "messages": []}, "invalid_request", True),  # two prompts
    ({"v": 1, "id": "x", "prompt": 5}, "invalid_request", True),
    ({"v": 1, "id": "x", "prompt_token_ids": [1, -2]}, "invalid_request", True),
    ({"v": 1, "id": "x", "prompt_token_ids": [1, True]}, "invalid_request", True),
    ({"v": 1, "id": "x", "messages": [{"role": "user"}]}, "invalid_request", True),
    ({"v": 1, "id": "x", "prompt": "hi", "params": [1]}, "invalid_params", True),
    ({"v": 1, "id": "x", "prompt": "hi", "priority": "high"}, "invalid_request", True),
    ({"v": 1, "id": "x", "prompt": "hi", "deadline": -1}, "invalid_request", True),
    ({"v": 1, "id": "x", "prompt": "hi", "deadline": 10**400}, "invalid_request", True),  # no float holds it
    ({"v": 1, "id": "bad id with spaces", "prompt": "hi"}, "invalid_request", False),
    ({"v": 1, "id": 7, "prompt": "hi"}, "invalid_request", False),
    ([1, 2, 3], "invalid_request", False),
])
def test_invalid_jobs(obj, code, has_id):
    with pytest.raises(ProtocolError) as info:
        decode_job(job_fields(obj))
    assert info.value.code == code
    assert (info.value.request_id == "x") is has_id


@pytest.mark.parametrize("fields, code", [
    ({b"json": b"\xff\xfe not json"}, "bad_encoding"),
    ({b"msgpack": b"\xc1"}, "bad_encoding"),
    ({b"msgpack": b"\x81\xa1a\x01trailing"}, "bad_encoding"),
    ({b"xml": b"<a/>"}, "bad_encoding"),
    ({b"json": b"{}", b"msgpack": b"\x80"}, "bad_encoding"),
    ({b"json": b"[" * 100_000 + b"]" * 100_000}, "bad_encoding"),  # deep JSON
    ({b"msgpack": b"\x91" * 100_000 + b"\xc0"}, "bad_encoding"),  # deep msgpack
    ({b"msgpack": b"\xdf\xff\xff\xff\xff"}, "bad_encoding"),  # a map claiming 4G entries
    ({b"msgpack": msgpack.packb({"v": 1, "id": "x", "prompt": "a" * (1 << 20)})}, "too_large"),
    ({b"json": b'{"v":1,"id":"x","prompt":"' + b"a" * (4 << 20) + b'"}'}, "too_large"),  # not even looked into
])
def test_undecodable(fields, code):
    with pytest.raises(ProtocolError) as info:
        decode_job(fields)
    assert info.value.code == code and info.value.request_id is None


def test_nesting_within_size_limit_rejected():
    obj = {"v": 1, "id": "x", "prompt": "p", "params": {"stop": [[[[[["deep"]]]]]]}}
    with pytest.raises(ProtocolError) as info:
        decode_job(job_fields(obj, "msgpack"), Limits())
    assert info.value.code == "bad_encoding"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["json", "msgpack"]))
def test_random_bytes_never_crash(data, encoding):
    try:
        decode_job({encoding: data})
    except ProtocolError as e:
        assert e.code in ("bad_encoding", "invalid_request", "unsupported_version", "invalid_params")


def test_event_ids_encode_seq():
    assert [event_stream_id(s) for s in (0, 1, 41)] == ["0-1", "0-2", "0-42"]
    assert seq_of_stream_id(b"0-42") == 41


def test_resume_state_folds_tokens_per_sample():
    def entry(event):
        return event_stream_id(event["seq"]).encode(), {b"msgpack": msgpack.packb(event)}

    events = [token_event("r", 0, 0, [5, 6], "ab"), token_event("r", 1, 1, [7], "c"),
              token_event("r", 2, 0, [8], "d")]
    state = resume_state([entry(e) for e in events])
    assert state.next_seq == 3 and not state.finished
    assert state.resume_token_ids(2) == [[5, 6, 8], [7]]
    assert resume_state([]).resume_token_ids(1) is None


def resume_entry(event: dict, encoding: str = "msgpack") -> tuple[bytes, dict[bytes, bytes]]:
    return event_stream_id(event["seq"]).encode(), {encoding.encode(): encode(event, encoding)}


def test_resume_gives_every_sample_its_tokens_even_when_some_have_none():
    state = resume_state([resume_entry(token_event("r", 0, 2, [9], "x"))])
    assert state.resume_token_ids(4) == [[], [], [9], []]
    assert resume_state([resume_entry(token_event("r", 0, 0, [], ""))]).resume_token_ids(1) is None


@pytest.mark.parametrize("terminal", [
    done_event("r", 2, ["length"], {"prompt_tokens": 1, "completion_tokens": 2}),
    error_event("r", 2, "internal", "boom"),
], ids=["done", "error"])
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_resume_sees_a_finished_stream(terminal, encoding):
    tokens = [token_event("r", 0, 0, [5], "a"), token_event("r", 1, 0, [6], "b")]
    state = resume_state([resume_entry(e, encoding) for e in [*tokens, terminal]])
    assert state.finished is True and state.next_seq == 3
    assert state.resume_token_ids(1) == [[5, 6]]
    assert resume_state([resume_entry(e, encoding) for e in tokens]).finished is False


@pytest.mark.parametrize("seqs", [[1], [0, 2], [0, 1, 1]])
def test_resume_refuses_a_stream_with_a_gap_or_repeat(seqs):
    entries = [resume_entry(token_event("r", s, 0, [5], "a")) for s in seqs]
    at, bad = next((i, s) for i, s in enumerate(seqs) if s != i)
    with pytest.raises(ValueError, match=f"has seq {bad} where {at} was expected"):
        resume_state(entries)


def test_decode_event_json():
    event = token_event("r", 0, 0, [1], "é")
    assert decode_event({b"json": json.dumps(event).encode()}) == event


def test_names_derive_from_the_prefix_and_each_can_be_overridden():
    n = Names(prefix="p")
    assert (n.requests, n.group, n.cancel, n.dead) == ("p:requests", "p:workers", "p:cancel", "p:dead")
    assert (n.events("r1"), n.tokens("r1"), n.worker("w"), n.job("r1"), n.cancelled("r1")) == \
        ("p:events:r1", "p:tokens:r1", "p:worker:w", "p:job:r1", "p:cancelled:r1")
    custom = Names(prefix="p", requests="in", group="g", cancel="c", dead="d")
    assert (custom.requests, custom.group, custom.cancel, custom.dead) == ("in", "g", "c", "d")
    assert Names().requests == "llm:requests"


def test_done_and_error_events_are_the_documented_shape():
    """docs/protocol.md's example, field for field."""
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}
    assert done_event("a1", 2, ["length", "stop"], usage) == {
        "v": 1, "id": "a1", "seq": 2, "type": "done", "index": 0, "token_ids": [], "text": "",
        "finish_reason": "length", "finish_reasons": ["length", "stop"], "usage": usage}
    assert error_event("a1", 3, "invalid_params", "max_tokens must be positive") == {
        "v": 1, "id": "a1", "seq": 3, "type": "error", "index": 0, "token_ids": [], "text": "",
        "code": "invalid_params", "message": "max_tokens must be positive"}
    assert token_event("a1", 0, 1, [9906], "Hello") == {
        "v": 1, "id": "a1", "seq": 0, "type": "token", "index": 1, "token_ids": [9906], "text": "Hello"}


VALID_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_messages_are_normalised_for_the_chat_template():
    """Text parts joined, tool-call arguments as objects (what templates render), the rest kept."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts, "name": "u"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    job = decode_job(job_fields({"v": 1, "id": "t1", "messages": messages, "tools": tools}))
    assert job.messages == [{"role": "user", "content": "ab", "name": "u"},
                            {"role": "assistant", "content": "", "tool_calls": [
                                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert job.tools == tools
    with pytest.raises(ProtocolError, match="needs `messages`"):
        decode_job(job_fields({"v": 1, "id": "t2", "prompt": "x", "tools": tools}))


@pytest.mark.parametrize("messages, ok", [
    (VALID_CHAT, True),
    ([{"role": "user", "content": ""}], True),
    ([], False),
    ("hi", False),
    (["hi"], False),
    ([{"role": "user", "content": "hi", "name": "x"}], True),
    ([{"role": "user", "content": "hi", "nam": "x"}], False),  # a typo is not ignored
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], True),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], False),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "2"}], True),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}], False),
    ([{"role": "user", "content": None}], False),
    ([{"role": 1, "content": "hi"}], False),
    ([{"role": "user", "content": ["hi"]}], False),
    ([{"content": "hi"}], False),
    ([{"role": "user", "content": "hi"}] * 3, False),  # over the limit of 2 set below
])
def test_chat_messages_are_checked(messages, ok):
    fields = job_fields({"v": 1, "id": "c1", "messages": messages})
    limits = Limits(max_messages=2)
    if ok:
        decoded = decode_job(fields, limits).messages
        assert [m["role"] for m in decoded] == [m["role"] for m in messages]
        assert all(isinstance(m["content"], str) for m in decoded)
        return
    with pytest.raises(ProtocolError) as info:
        decode_job(fields, limits)
    assert info.value.code == "invalid_request" and info.value.request_id == "c1"
    assert "message" in str(info.value)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_pubsub_messages_and_event_entries_decode_in_either_encoding(encoding):
    event = token_event("a1", 4, 0, [1, 2], "hé", logprobs=[{1: -0.25}, {2: -1.5, 7: -2.0}])
    raw = encode(event, encoding)
    assert decode_message(raw) == {**event, "logprobs": [[[1, -0.25]], [[2, -1.5], [7, -2.0]]]}
    if encoding == "json":
        assert decode_message(raw.decode()) == decode_message(raw)  # pub/sub may hand over text
    assert decode_event({encoding.encode(): raw}) == decode_message(raw)


ALLOWED = ("['deadline', 'id', 'lora', 'messages', 'options', 'params', 'priority', 'prompt', 'prompt_token_ids', "
           "'session', 'task', 'tenant', 'tool_choice', 'tools', 'traceparent', 'v']")
CHAT = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
NAMED_F = {"type": "function", "function": {"name": "f"}}
TOOL_CHOICE_SHAPE = ('`tool_choice` must be "auto", "none", "required" or {"type": "function", "function": '
                     '{"name": string}}')


@pytest.mark.parametrize("obj, code, message", [
    ([1, 2], "invalid_request", "a request must be a map, not list"),
    ({"v": 1, "id": "bad id", "prompt": "x"}, "invalid_request",
     "`id` must be a string of 1-128 characters from A-Z a-z 0-9 . _ : @ / + = -"),
    ({"v": 1, "id": "x", "prompt": "hi", "extra": 1, "b": 2}, "invalid_request",
     f"unknown field(s) ['b', 'extra']; allowed: {ALLOWED}"),
    ({"v": 2, "id": "x", "prompt": "hi"}, "unsupported_version", "`v` must be 1 (schema version), got 2"),
    ({"v": 1, "id": "x"}, "invalid_request",
     "exactly one of ['prompt', 'prompt_token_ids', 'messages'] is required, got []"),
    ({"v": 1, "id": "x", "prompt": ""}, "invalid_request", "`prompt` must be a non-empty string"),
    ({"v": 1, "id": "x", "prompt_token_ids": 5}, "invalid_request",
     "`prompt_token_ids` must be a non-empty list of non-negative integers"),
    ({"v": 1, "id": "x", "prompt_token_ids": []}, "invalid_request",
     "`prompt_token_ids` must be a non-empty list of non-negative integers"),
    ({"v": 1, "id": "x", "prompt": "hi", "params": "ab"}, "invalid_params",
     "`params` must be a map from field name to value"),
    ({"v": 1, "id": "x", "prompt": "hi", "priority": 2**31 + 1}, "invalid_request",
     "`priority` must be an integer from -2**31 to 2**31"),
    ({"v": 1, "id": "x", "prompt": "hi", "deadline": -1}, "invalid_request",
     "`deadline` must be a unix time in milliseconds (0 to 2**63-1)"),
    ({"v": 1, "id": "x", "prompt": "hi", "lora": "base:adapter"}, "invalid_request",
     "`lora` must be 1 to 64 letters, digits, '.', '_' or '-'"),
    ({"v": 1, "id": "x", "prompt": "hi", "lora": 3}, "invalid_request",
     "`lora` must be 1 to 64 letters, digits, '.', '_' or '-'"),
    ({"v": 1, "id": "x", "prompt": "hi", "tenant": "a b"}, "invalid_request",
     "`tenant` must be 1 to 64 letters, digits, '.', '_' or '-'"),
    ({"v": 1, "id": "x", "prompt": "hi", "tenant": 7}, "invalid_request",
     "`tenant` must be 1 to 64 letters, digits, '.', '_' or '-'"),
    ({"v": 1, "id": "x", "prompt": "hi", "session": ""}, "invalid_request",
     "`session` must be a non-empty string of at most 256 characters"),
    ({"v": 1, "id": "x", "prompt": "hi", "session": "s" * 257}, "invalid_request",
     "`session` must be a non-empty string of at most 256 characters"),
    ({"v": 1, "id": "x", "messages": [{"role": "u"}]}, "invalid_request",
     'a message\'s `content` must be a string or a list of {"type": "text", "text": string} parts'),
    ({"v": 1, "id": "x", "messages": [{"role": "u", "content": "x"}], "tools": [{"type": "fn"}]}, "invalid_request",
     'each tool must be {"type": "function", "function": {"name": string, "description": string, "parameters": '
     'JSON Schema}}'),
    ({"v": 1, "id": "x", "messages": CHAT, "tool_choice": "auto"}, "invalid_request", "`tool_choice` needs `tools`"),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": "always"}, "invalid_request",
     TOOL_CHOICE_SHAPE),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "name": "f"}},
     "invalid_request", TOOL_CHOICE_SHAPE),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}}, "invalid_request", TOOL_CHOICE_SHAPE),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": {**NAMED_F, "function": {"name": "g"}}},
     "invalid_request", "`tool_choice` names the function 'g', which is not in `tools`"),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": [], "tool_choice": "required"}, "invalid_request",
     '`tool_choice` "required" needs at least one tool in `tools`'),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": "required",
      "params": {"structured_outputs": {"regex": "a"}}}, "invalid_params",
     '`tool_choice` "required" constrains the output itself: it cannot be combined with params.structured_outputs'),
    ({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": NAMED_F,
      "params": {"structured_outputs": {"regex": "a"}}}, "invalid_params",
     "`tool_choice` naming a function constrains the output itself: it cannot be combined with "
     "params.structured_outputs"),
])
def test_a_rejected_job_says_exactly_what_is_wrong(obj, code, message):
    with pytest.raises(ProtocolError) as info:
        decode_job(job_fields(obj))
    assert (info.value.code, str(info.value)) == (code, message)


@pytest.mark.parametrize("choice", ["auto", "none", "required", NAMED_F])
def test_tool_choice_is_kept_as_given(choice):
    job = decode_job(job_fields({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": choice}))
    assert job.tool_choice == choice
    # auto and none constrain nothing, so they may come with a constraint of the job's own
    if choice in ("auto", "none"):
        params = {"structured_outputs": {"regex": "a"}}
        assert decode_job(job_fields({"v": 1, "id": "x", "messages": CHAT, "tools": TOOLS, "tool_choice": choice,
                                      "params": params})).params == params


def test_tools_the_gateway_parsed_are_taken_as_they_are_and_nothing_else_is():
    """The OpenAI parser checks `tools` and `tool_choice` with OpenAI's errors and builds them into the
    job: the gateway's check of that job (`tools_parsed`) does not parse them again. Whatever reads a
    job from a client or from Redis (decode_job: the worker) checks them, and every other field."""
    job = {"v": 1, "id": "x", "messages": CHAT, "tools": [{"type": "fn"}], "tool_choice": "always"}
    with pytest.raises(ProtocolError, match="each tool must be"):
        decode_job(job_fields(job))
    parsed = parse_job(job, "json", tools_parsed=True)
    assert (parsed.tools, parsed.tool_choice) == (job["tools"], "always")
    with pytest.raises(ProtocolError, match="`tools` needs `messages`"):
        parse_job({**{k: v for k, v in job.items() if k != "messages"}, "prompt": "x"}, "json", tools_parsed=True)
    with pytest.raises(ProtocolError, match="nested deeper"):  # the schemas' depth bound still holds
        deep: dict = {}
        for _ in range(70):
            deep = {"a": deep}
        parse_job({**job, "tools": [deep]}, "json", tools_parsed=True)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_accepted_values_at_their_limits(encoding):
    job = decode_job(job_fields({"v": 1, "id": "x", "prompt_token_ids": [0, 5], "priority": -(2**31),
                                 "deadline": 0}, encoding))
    assert (job.prompt_token_ids, job.prompt, job.priority, job.deadline) == ([0, 5], None, -(2**31), 0)
    assert decode_job(job_fields({"v": 1, "id": "x", "prompt": "a", "priority": 2**31}, encoding)).priority == 2**31
    job = decode_job(job_fields({"v": 1, "id": "x", "prompt": "a", "tenant": "acme-1", "session": "conv/7"}, encoding))
    assert (job.tenant, job.session) == ("acme-1", "conv/7")


def test_payload_size_and_depth_limits_are_inclusive():
    raw = encode({"v": 1, "id": "x", "prompt": "hi"}, "json")
    assert decode_job({b"json": raw}, Limits(max_payload_bytes=len(raw))).prompt == "hi"
    with pytest.raises(ProtocolError) as info:
        decode_job({b"json": raw}, Limits(max_payload_bytes=len(raw) - 1))
    assert (info.value.code, str(info.value)) == ("too_large", f"payload is {len(raw)} bytes; the limit is "
                                                                f"{len(raw) - 1}")
    nested = {"v": 1, "id": "x", "prompt": "hi", "params": {"a": [[[1]]]}}  # 6 levels, the 1 included
    assert decode_job(job_fields(nested), Limits(max_depth=6)).params == {"a": [[[1]]]}
    with pytest.raises(ProtocolError) as info:
        decode_job(job_fields(nested), Limits(max_depth=5))
    assert (info.value.code, str(info.value)) == ("bad_encoding", "payload is nested deeper than 5 levels")


# (entry fields, expected code): each is refused, and the error carries the id "x" (issue 13: a job
# whose id can be read is answered with an error event, never only dead-lettered).
REFUSED_WITH_ID = [
    (job_fields({"v": 1, "id": "x", "prompt": "p", "params": {"a": [[[[1]]]]}}), "bad_encoding"),  # 7 levels
    (job_fields({"v": 1, "id": "x", "prompt": "p", "params": {"a": [[[[1]]]]}}, "msgpack"), "bad_encoding"),
    ({b"json": b'{"v":1,"id":"x","prompt":"p","params":{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"},
     "bad_encoding"),  # too deep for the JSON decoder itself
    ({b"json": b'{"v":1,"id":"x","prompt":"p","params":{"max_tokens":1,}}'}, "bad_encoding"),  # broken inside
    ({b"json": b'{"v":1,"id":"x","prompt":"' + b"a" * (1 << 20) + b'"}'}, "too_large"),
    ({b"json": b'{"v":1,"id":"x","prompt":"a\\ud800b"}'}, "invalid_request"),  # a lone surrogate escape
    ({b"json": b'{"v":1,"id":"x","messages":[{"role":"user","content":"\xff\xfe"}]}'}, "invalid_request"),
    ({b"msgpack": b"\x83\xa1v\x01\xa2id\xa1x\xa6prompt\xa3\xed\xa0\x80"}, "invalid_request"),  # UTF-8 of U+D800
    ({b"msgpack": msgpack.packb({"v": 1, "id": "x", "prompt": "p", "params": {"stop": ["\udcff"]}},
                                unicode_errors="surrogateescape")}, "invalid_request"),  # a stop string of byte 0xff
    (job_fields({"v": 1, "id": "x", "prompt_token_ids": [1] * 11}), "invalid_request"),  # over max_items (10)
]


@pytest.mark.parametrize("fields, code", REFUSED_WITH_ID)
def test_refused_jobs_carry_their_id_when_it_can_be_read(fields, code):
    with pytest.raises(ProtocolError) as info:
        decode_job(fields, Limits(max_items=10))
    assert (info.value.code, info.value.request_id) == (code, "x"), info.value.message
    json.dumps(info.value.message).encode()  # the message itself never quotes unencodable text


def test_lone_surrogates_are_refused_before_anything_quotes_them():
    with pytest.raises(ProtocolError) as info:
        parse_job({"v": 1, "id": "x", "prompt": "p", "\ud800": 1}, "json")  # an unknown field, but unencodable
    assert info.value.code == "invalid_request" and "valid Unicode" in info.value.message
    # Paired surrogate escapes are one ordinary character.
    assert decode_job({b"json": b'{"v":1,"id":"x","prompt":"\\ud83d\\ude00"}'}).prompt == "\U0001f600"


@pytest.mark.parametrize("text, rid", [
    ('{"id":"a","p":' + "[" * 5000 + "]" * 5000 + "}", "a"),
    ('{"p":{"q":[1,{"r":"}]"}]},"id":"late"}', "late"),  # brackets inside strings do not count
    ('{"id":"a","p":{"x":1,}}', "a"),
    ('{"id":"a","p":"unterminated}', None),
    ('{"id":"bad id","p":[[]]}', None),
    ('{"id":"a"}}', None),
    ("[" * 100 + "]" * 100, None),
    ('{"id":"a","p":[[[', None),
])
def test_readable_id(text, rid):
    assert readable_id(text) == rid


def test_undecodable_payloads_name_the_decoder_error():
    with pytest.raises(ProtocolError) as info:
        decode_job({b"json": b"{"})
    assert info.value.code == "bad_encoding" and str(info.value).startswith(
        "cannot decode json payload (JSONDecodeError: Expecting property name")
    with pytest.raises(ProtocolError) as info:
        decode_job({b"json": b"[" * 100_000})
    assert (info.value.code, str(info.value)) == ("bad_encoding", "payload is nested too deeply")
    with pytest.raises(ProtocolError) as info:
        decode_job({b"json": b"{}", b"x": b""})
    assert str(info.value) == "an entry needs exactly one field, `json` or `msgpack`; got ['json', 'x']"


def test_msgpack_specifics_items_map_keys_ext_types():
    items = msgpack.packb({"v": 1, "id": "x", "prompt_token_ids": list(range(11))})
    with pytest.raises(ProtocolError) as info:
        decode_job({b"msgpack": items}, Limits(max_items=10))
    assert info.value.code == "bad_encoding" and "exceeds max_array_len(10)" in str(info.value)
    wide = msgpack.packb({"v": 1, "id": "x", "prompt": "hi", "params": {f"k{i}": i for i in range(11)}})
    with pytest.raises(ProtocolError) as info:
        decode_job({b"msgpack": wide}, Limits(max_items=10))
    assert info.value.code == "bad_encoding" and "exceeds max_map_len(10)" in str(info.value)
    int_keys = msgpack.packb({"v": 1, "id": "x", "prompt": "hi", "params": {1: 2}})
    with pytest.raises(ProtocolError) as info:
        decode_job({b"msgpack": int_keys})
    assert info.value.code == "invalid_params"  # decoded, then refused by the schema
    ext = msgpack.packb({"v": 1, "id": "x", "prompt": msgpack.ExtType(1, b"a")})
    with pytest.raises(ProtocolError) as info:
        decode_job({b"msgpack": ext})
    assert info.value.code == "bad_encoding"


def test_encodings_are_compact_utf8_json_and_binary_safe_msgpack():
    assert encode({"t": "é", "n": [1, 2]}, "json") == '{"t":"é","n":[1,2]}'.encode()
    packed = encode({"b": b"\xff\x00"}, "msgpack")
    assert msgpack.unpackb(packed, raw=False) == {"b": b"\xff\x00"}
    assert list(encode_job({"id": "a", "prompt": "x"})) == ["json"]


def test_events_are_not_held_to_job_limits_but_to_their_own_depth():
    long_text = token_event("a1", 0, 0, [1], "x" * (2 << 20))  # over a job's 1 MiB
    for encoding in ("json", "msgpack"):
        assert decode_message(encode(long_text, encoding))["text"] == long_text["text"]
        assert decode_event({encoding: encode(long_text, encoding)})["text"] == long_text["text"]
    deep = {"usage": [[[[[[1]]]]]]}  # 8 levels (the 1 included): as deep as an event may be
    assert decode_message(encode(deep, "json")) == deep == decode_event({"json": encode(deep, "json")})
    with pytest.raises(ProtocolError):
        decode_message(encode({"usage": [[[[[[[1]]]]]]]}, "json"))
    with pytest.raises(ProtocolError):
        decode_event({"json": encode({"usage": [[[[[[[1]]]]]]]}, "json")})


def test_an_undecodable_pubsub_message_names_its_encoding():
    with pytest.raises(ProtocolError) as info:
        decode_message(b"\xc1")  # never used in msgpack
    assert info.value.code == "bad_encoding" and str(info.value).startswith("cannot decode msgpack payload")


@pytest.mark.parametrize("value", ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
                                   "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case
                                   "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", 7, ""])
def test_a_traceparent_must_be_a_w3c_trace_context(value: object) -> None:
    with pytest.raises(ProtocolError, match="traceparent"):
        parse_job({"v": 1, "id": "t", "prompt": "x", "traceparent": value}, "json")
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert parse_job({"v": 1, "id": "t", "prompt": "x", "traceparent": good}, "json").traceparent == good


@pytest.mark.parametrize(("extra", "said"), [
    ({"task": "translate"}, "`task` must be one of"),
    ({"task": "tokenize", "options": {"add_special_tokens": "yes"}}, "option `add_special_tokens` must be a boolean"),
    ({"task": "tokenize", "options": ["add_special_tokens"]}, "`options` must be a map"),
    ({"task": "embed", "options": {"pooling": "cls"}}, "option `pooling` must be one of ['last', 'mean']"),
    ({"task": "embed", "options": {"dimensions": 0}}, "option `dimensions` must be a positive integer"),
    ({"task": "embed", "options": {"dimensions": True}}, "option `dimensions` must be a positive integer"),
    ({"task": "tokenize", "options": {"echo": True}}, "unknown option(s) ['echo']"),
    ({"options": {"add_special_tokens": True}}, "for task 'generate'"),
    ({"task": "detokenize"}, "takes `prompt_token_ids`"),
])
def test_a_task_job_says_what_is_wrong_with_it(extra: dict, said: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(said)):
        parse_job({"v": 1, "id": "t", "prompt": "x", **extra}, "json")
    tokenize = parse_job({"v": 1, "id": "t", "prompt": "x", "task": "tokenize",
                          "options": {"return_token_strs": True}}, "json")
    assert (tokenize.task, tokenize.options) == ("tokenize", {"return_token_strs": True})
    assert parse_job({"v": 1, "id": "t", "prompt": "x"}, "json").task == "generate"
