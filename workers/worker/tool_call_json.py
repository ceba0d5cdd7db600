"""The JSON pieces every tool-call parser reads (workers/worker/tool_parsers.py): where a JSON value ends,
whether text opens a call object (`{"name": "...", "arguments": `), and the deltas a parser hands out.

Scanning is structural (brackets, strings and escapes are followed, nothing is validated): a model's
half-written or broken JSON still has an end and a length, and the same rule holds whether the text
arrives whole or a character at a time, which is what makes streaming give exactly the whole parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

WS = " \t\n\r"  # JSON's whitespace (not Python's str.isspace, which knows more)
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/OpenAI say arguments, Llama 3 parameters
# The header of a call object, for parsing whole texts (the streaming side is `header`, below).
HEADER_RE = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,'
                       r'[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*', re.S)

IdMaker = Callable[[int], str]


def index_ids(i: int) -> str:
    """Default call ids: deterministic, so a parse can be repeated (the worker passes its own)."""
    return f"call_{i}"


class Extent:
    """Finds where one JSON value ends in text fed piecewise. `feed(text)` -> (begin, end): the slice
    of `text` that belongs to the value (begin skips whitespace before it; end None: it goes on)."""

    def __init__(self) -> None:
        self.started = self.scalar = self.in_string = self.escaped = self.done = False
        self.depth = 0

    def feed(self, text: str) -> tuple[int, int | None]:
        begin = 0
        for i, ch in enumerate(text):
            if not self.started:
                if ch in WS:
                    begin = i + 1
                    continue
                self.started, self.scalar = True, ch not in '{["'
            end = self._step(ch, i)
            if end is not None:
                self.done = True
                return begin, end
        return begin, None

    def _step(self, ch: str, i: int) -> int | None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return i + 1 if self.depth == 0 else None
            return None
        if self.scalar:  # a number, true, false, null: up to the next delimiter (not part of it)
            return i if ch in WS or ch in ",}]" else None
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return i + 1 if self.depth <= 0 else None
        return None


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def value_end(text: str, start: int = 0) -> int | None:
    """Index just past the JSON value starting at text[start] (after whitespace); None: unfinished."""
    _, end = Extent().feed(text[start:])
    return None if end is None else start + end


def _expect(text: str, pos: int, options: tuple[str, ...]) -> tuple[str, int]:
    """Whitespace, then one of `options` at `pos`: ("match", after it), ("partial", _) when the text
    ends on the way, or ("fail", _)."""
    while pos < len(text) and text[pos] in WS:
        pos += 1
    rest = text[pos:]
    for option in options:
        if rest.startswith(option):
            return "match", pos + len(option)
    if any(option.startswith(rest) for option in options):
        return "partial", pos
    return "fail", pos


def _string_end(text: str, pos: int) -> int | None:
    """Index past the JSON string opening at text[pos] (a quote), None when it is not closed yet."""
    escaped = False
    for i in range(pos + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None


def header(text: str) -> tuple[str, str | None, int]:
    """Whether `text` opens a call object, `{"name": STRING, "arguments": ` ("parameters" too):
    ("match", name, index after the colon), ("partial", None, 0) while it may still, or ("fail", ...)."""
    pos, name = 0, None
    for step in ("{", '"name"', ":", "name", ",", tuple(f'"{k}"' for k in ARGUMENT_KEYS), ":"):
        if step == "name":
            status, pos = _expect(text, pos, ('"',))
            end = _string_end(text, pos - 1) if status == "match" else None
            if status == "match" and end is None:
                return "partial", None, 0
            if status != "match":
                return status, None, 0
            try:
                name = json.loads(text[pos - 1:end])
            except ValueError:
                return "fail", None, 0
            pos = end
            continue
        status, pos = _expect(text, pos, step if isinstance(step, tuple) else (step,))
        if status != "match":
            return status, None, 0
    return "match", name, pos


def call_of(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call object, None when it is not one. The arguments
    are the model's own text when the object starts with its name (what streaming hands out as it
    comes); a call written in another key order is read with a JSON parser and its arguments dumped."""
    m = HEADER_RE.match(body)
    name = _name(m.group(1)) if m else None
    if m and name is not None:
        end = value_end(body, m.end())
        return name, body[m.end():] if end is None else body[m.end():end]
    return reordered_call(body)


def _name(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:
        return None


def reordered_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body, strict=False)  # a raw control character, as constrained JSON may hold
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in ARGUMENT_KEYS if k in obj), None)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class Deltas:
    """What one feed hands out: content text, and OpenAI-style tool-call deltas (a call's first
    delta carries id, type and name; later ones of the same call append argument text, merged)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def text(self, text: str) -> None:
        if text:
            self.content.append(text)

    def start(self, index: int, call_id: str, name: str, arguments: str = "") -> None:
        self.calls.append({"index": index, "id": call_id, "type": "function",
                           "function": {"name": name, "arguments": arguments}})

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self.calls and self.calls[-1]["index"] == index:
            self.calls[-1]["function"]["arguments"] += text
        else:
            self.calls.append({"index": index, "function": {"arguments": text}})

    def take(self) -> tuple[str, list[dict[str, Any]]]:
        out = "".join(self.content), self.calls
        self.content, self.calls = [], []
        return out


class CallScanner:
    """One call object's text, fed piecewise: the call starts (id, name) as soon as its header is
    complete, then its arguments value streams as it is written. An object that does not start with
    its name is kept until `close()`, then read whole (`reordered_call`)."""

    def __init__(self, out: Deltas, index: int, make_id: IdMaker) -> None:
        self.out, self.index, self.make_id = out, index, make_id
        self.state = "header"  # -> "arguments" -> "rest"; or "whole"
        self.buffer = ""
        self.value = Extent()

    def feed(self, text: str) -> None:
        if self.state in ("header", "whole"):
            self.buffer += text
            if self.state == "whole":
                return
            status, name, end = header(self.buffer)
            if status == "fail":
                self.state = "whole"
            if status != "match":
                return
            assert name is not None
            self.out.start(self.index, self.make_id(self.index), name)
            self.state, text, self.buffer = "arguments", self.buffer[end:], ""
        if self.state == "arguments":
            begin, end = self.value.feed(text)
            self.out.arguments(self.index, text[begin:end])
            if end is not None:
                self.state = "rest"  # what follows the arguments (the object's `}`) is not handed out

    def close(self) -> bool:
        """The object ended: True when it was a call (all of it handed out now)."""
        if self.state in ("arguments", "rest"):
            return True
        call = reordered_call(self.buffer)
        if call is None:
            return False
        self.out.start(self.index, self.make_id(self.index), *call)
        return True
