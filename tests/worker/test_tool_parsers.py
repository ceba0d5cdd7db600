"""Tool-call parsers (workers/worker/tool_parsers.py) on crafted outputs: each family's whole parse is what the
format means, and streaming the same text, split at every character position (and char by char, and
at random places of generated texts), hands out exactly the whole parse, in well-formed deltas."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_messages import TEMPLATE as HERMES_TEMPLATE

from streamer.random_checkpoint import CHAT_TEMPLATE
from workers.worker.tool_parsers import (
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    ParsedOutput,
    ToolCall,
    ToolParser,
    family_of,
)

Calls = list[tuple[str, str]]  # (name, arguments)

HERMES: list[tuple[str, str, Calls]] = [
    ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search", "arguments": {"q": "snow"}}\n</tool_call>',
     "Let me look.\n\n", [("get_weather", '{"city": "Oslo", "unit": "C"}'), ("search", '{"q": "snow"}')]),
    ("No tools: 2 < 3, and <tool is not a tag <tool_ca", "No tools: 2 < 3, and <tool is not a tag <tool_ca", []),
    ('<tool_call>{"name": "echo", "arguments": {"s": "a } \\" ] </tool_c", "n": [1, {"x": null}]}}</tool_call>',
     "", [("echo", '{"s": "a } \\" ] </tool_c", "n": [1, {"x": null}]}')]),
    ('<tool_call>\n{"name": "cut", "arguments": {"a": [1, 2', "", [("cut", '{"a": [1, 2')]),  # max_tokens ran out
    ('<tool_call>{"arguments": {"k": "v"}, "name": "reordered"}</tool_call>', "", [("reordered", '{"k": "v"}')]),
    ("A <tool_call>not json</tool_call> B", "A <tool_call>not json</tool_call> B", []),
    ('x<tool_call>{"name": "f", "arguments": {}}</tool_call>  \n <tool_call>{"name": "g", "arguments": 5 }'
     '</tool_call>\n', "x", [("f", "{}"), ("g", "5")]),  # whitespace between and after blocks is dropped
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> then text', " then text", [("f", "{}")]),
    ('<tool_call>{"name": "Zürich", "arguments": {"ville": "日本 🙂"}}</tool_call>', "",
     [("Zürich", '{"ville": "日本 🙂"}')]),
    ('<tool_call>{"na', '<tool_call>{"na', []),  # a call cut before its name is not one
    ('<tool_call>{"name": "bad\\q", "arguments": {}}</tool_call>', '<tool_call>{"name": "bad\\q", "arguments": {}}'
     "</tool_call>", []),
    ("", "", []),
    ("ends with <", "ends with <", []),
]

LLAMA: list[tuple[str, str, Calls]] = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": [1, ";"]}}', "",
     [("f", "{}"), ("g", '{"x": [1, ";"]}')]),
    (' \n {"name": "f", "parameters": {"a": "b;c"}} ;\n{"name": "g", "parameters": {"n": -1.5e3}}  ', "",
     [("f", '{"a": "b;c"}'), ("g", '{"n": -1.5e3}')]),
    ('Hello, {"name": "f", "parameters": {}}', 'Hello, {"name": "f", "parameters": {}}', []),
    ('{"foo": 1} and more', '{"foo": 1} and more', []),
    ('{"parameters": {"a": 1}, "name": "f"}', "", [("f", '{"a": 1}')]),
    ('{"name": "f", "parameters": {"a": "x', "", [("f", '{"a": "x')]),
    ('{"name": "f", "parameters": {}}; done', "done", [("f", "{}")]),
    ('{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}', '{"name": "g", "parameters": {}}',
     [("f", "{}")]),  # no separator: not a second call
    ('{"name": "f", "parameters": {}}; {"other": 1}', '{"other": 1}', [("f", "{}")]),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("<|python_ta", "<|python_ta", []),
    ("   ", "   ", []),
]

ARRAY: list[tuple[str, str, Calls]] = [
    ('[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{"b":"x]"}}]', "",
     [("f", '{"a":1}'), ("g", '{"b":"x]"}')]),
    ('[{"name":"now","parameters":{}}]', "", [("now", "{}")]),
    # Cut by max_tokens: a call cut before its arguments is dropped, never content.
    ('[{"name":"f","parameters":{"a":1}},{"name":"g","param', "", [("f", '{"a":1}')]),
    ('[{"name":"f","parameters":{"a":1}},{"name":', "", [("f", '{"a":1}')]),
    ('[{"name":', "", []),
    ("[", "", []),
    ('[{"name":"f","parameters":{"a":', "", [("f", '{"a":')]),
    ("[]", "", []),
]


def streamed(parser: ToolParser, pieces: list[str]) -> ParsedOutput:
    """Feed the pieces, then finish: the content and calls the deltas add up to, checking each delta's
    shape (a call opens with index, id, type and name; later deltas of it only append arguments)."""
    content, calls = [], []
    for k, piece in enumerate([*pieces, ""]):
        text, deltas = parser.feed(piece, final=k == len(pieces))
        content.append(text)
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                assert set(d["function"]) == {"name", "arguments"}
                calls.append(ToolCall(d["id"], d["function"]["name"], d["function"]["arguments"]))
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
                assert d["index"] == len(calls) - 1 and d["function"]["arguments"]  # appends to the open call
                calls[-1].arguments += d["function"]["arguments"]
    return ParsedOutput("".join(content), calls)


def check_family(cls: type[ToolParser], text: str, content: str, calls: Calls, *args: Any) -> None:
    whole = cls(*args).parse(text)
    assert (whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == (content, calls), text
    assert [c.id for c in whole.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    assert streamed(cls(*args), list(text)) == whole, text
    for cut in range(len(text) + 1):
        assert streamed(cls(*args), [text[:cut], text[cut:]]) == whole, (text, cut)


@pytest.mark.parametrize("text, content, calls", HERMES)
def test_hermes(text: str, content: str, calls: Calls) -> None:
    check_family(HermesToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", LLAMA)
def test_llama3_json(text: str, content: str, calls: Calls) -> None:
    check_family(Llama3JsonToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", ARRAY)
def test_json_array_of_required_calls(text: str, content: str, calls: Calls) -> None:
    check_family(JsonArrayToolParser, text, content, calls)


@pytest.mark.parametrize("text", ['{"city":"Oslo","days":3}', '{"city":"Os', ""])
def test_named_function_the_whole_output_is_its_arguments(text: str) -> None:
    check_family(NamedToolParser, text, "", [("get_weather", text)], "get_weather")


def test_arguments_stream_as_they_are_written_and_tags_are_held_back() -> None:
    """What a client sees mid-way: the name as soon as the header is complete, argument text as it
    comes, and nothing of a tag's possible start."""
    p = HermesToolParser(lambda i: f"id{i}")
    assert p.feed("Hi <tool") == ("Hi ", [])
    assert p.feed('_call>\n{"name": "f", "argu') == ("", [])
    assert p.feed('ments": {"a": 1') == ("", [{"index": 0, "id": "id0", "type": "function",
                                              "function": {"name": "f", "arguments": '{"a": 1'}}])
    assert p.feed("}}\n</tool_") == ("", [{"index": 0, "function": {"arguments": "}"}}])
    assert p.feed("call>") == ("", []) and p.calls == 1
    assert p.finish() == ("", [])


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", '{"name": "f", "arguments": ',
             '{"name":"g","parameters":', "{", "}", "[", "]", '"', "\\", ",", ";", ":", " ", "\n", "ab", "é",
             "<|python_tag|>", '"x"', "12", "null"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.lists(st.integers(0, 200), max_size=6),
       st.sampled_from([HermesToolParser, Llama3JsonToolParser, JsonArrayToolParser]))
def test_streaming_any_split_of_any_text_gives_the_whole_parse(parts: list[str], cuts: list[int],
                                                               cls: type[ToolParser]) -> None:
    text = "".join(parts)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = cls().parse(text)
    assert streamed(cls(), pieces) == whole
    for call in whole.tool_calls:  # nothing is lost or made up: every call's text is in the output
        assert call.name in text and (call.arguments in text or json.loads(call.arguments) is not None)


LLAMA3_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
                   "<|eot_id|>{% endfor %}")


def test_the_family_comes_from_the_chat_template() -> None:
    assert family_of(HERMES_TEMPLATE) == "hermes"
    assert family_of(LLAMA3_TEMPLATE) == "llama3_json"
    assert family_of("{{ '<|python_tag|>' }}") == "llama3_json"
    assert family_of({"default": CHAT_TEMPLATE, "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert family_of(CHAT_TEMPLATE) is None and family_of(None) is None  # unknown: no parsing for auto
