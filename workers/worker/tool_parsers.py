"""Tool calls in a model's output: content text and OpenAI-style calls (docs/structured_outputs.md).

One class per output format. Each parses a whole text (`parse`) and streams (`feed` text deltas, then
`finish`), handing out content deltas and tool-call deltas (`[{"index", "id", "type": "function",
"function": {"name", "arguments"}}]`; a call's later deltas append argument text). Text that may be
the start of a tag is held back until it is known not to be. Streaming any split of a text gives
exactly its whole parse: tests/worker/test_tool_parsers.py holds every parser to it, split at every character.

  hermes       Hermes / Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any
               number; text before them is content.
  llama3_json  Llama 3.x: the whole output is `{"name": ..., "parameters": {...}}`, optionally after
               `<|python_tag|>`, several separated by `;`.
  json_array   what `tool_choice: "required"` constrains the output to: `[{"name", "parameters"}, ...]`.
  named        `tool_choice` naming a function: the whole output is that function's arguments.
Pure Python: the worker runs one per sample (workers/worker/tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.worker.tool_call_json import (
    WS,
    CallScanner,
    Deltas,
    Extent,
    IdMaker,
    call_of,
    held_back,
    index_ids,
    value_end,
)

Delta = tuple[str, list[dict[str, Any]]]  # (content text, tool-call deltas)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """Base: a streaming parser of one sample (feed, then finish once); `parse` reads a whole text."""

    def __init__(self, make_id: IdMaker = index_ids) -> None:
        self.make_id = make_id
        self.out = Deltas()
        self.calls = 0  # calls started so far

    def feed(self, text: str, final: bool = False) -> Delta:
        """A text delta; `final`: the output ends with it (what was held back is decided then)."""
        self._feed(text)
        if final:
            self._finish()
        return self.out.take()

    def finish(self) -> Delta:
        return self.feed("", final=True)

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _call(self) -> CallScanner:
        self.calls += 1
        return CallScanner(self.out, self.calls - 1, self.make_id)

    def _whole(self, content: str, calls: list[tuple[str, str]]) -> ParsedOutput:
        return ParsedOutput(content, [ToolCall(self.make_id(i), n, a) for i, (n, a) in enumerate(calls)])


class HermesToolParser(ToolParser):
    """`<tool_call>` blocks. Text before the first is content; text between and after blocks is
    content unless it is only whitespace; a block that holds no call is content, tags and all."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, make_id: IdMaker = index_ids) -> None:
        super().__init__(make_id)
        self.state = "content"  # or "block", "gap" (after a block)
        self.buffer = ""  # text not handed out yet: a tag's possible start, a gap, a block's body
        self.body = ""  # the current block's text so far (content, if it holds no call)
        self.call: CallScanner | None = None

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.START)
        if at < 0:
            return ParsedOutput(text)
        content, calls = [text[:at]], []
        while at >= 0:
            body_at = at + len(self.START)
            end = text.find(self.END, body_at)
            body = text[body_at:] if end < 0 else text[body_at:end]
            call = call_of(body)
            if call is None:
                content.append(text[at:] if end < 0 else text[at:end + len(self.END)])
            else:
                calls.append(call)
            if end < 0:
                break
            gap_at = end + len(self.END)
            at = text.find(self.START, gap_at)
            gap = text[gap_at:] if at < 0 else text[gap_at:at]
            content.append(gap if gap.strip() else "")
        return self._whole("".join(content), calls)

    def _feed(self, text: str) -> None:
        self.buffer += text
        while self._step():
            pass

    def _step(self) -> bool:
        """Take what the buffer decides; True when the state changed (look again)."""
        if self.state == "block":
            return self._block()
        at = self.buffer.find(self.START)
        if at >= 0:
            before = self.buffer[:at]
            self.out.text(before if self.state == "content" or before.strip() else "")
            self.state, self.buffer, self.body = "block", self.buffer[at + len(self.START):], ""
            self.call = self._call()
            return True
        keep = held_back(self.buffer, self.START)
        ready = self.buffer[:len(self.buffer) - keep]
        if self.state == "gap" and not ready.strip():
            return False  # whitespace after a block: dropped unless text follows it
        self.state = "content"
        self.out.text(ready)
        self.buffer = self.buffer[len(ready):]
        return False

    def _block(self) -> bool:
        assert self.call is not None
        end = self.buffer.find(self.END)
        if end < 0:
            keep = held_back(self.buffer, self.END)
            part, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            self.body += part
            self.call.feed(part)
            return False
        part, self.buffer = self.buffer[:end], self.buffer[end + len(self.END):]
        self.body += part
        self.call.feed(part)
        self._close_block(self.START + self.body + self.END)
        self.state = "gap"
        return True

    def _close_block(self, raw: str) -> None:
        assert self.call is not None
        if not self.call.close():
            self.calls -= 1  # not a call after all: its index goes to the next one
            self.out.text(raw)
        self.call = None

    def _finish(self) -> None:
        if self.state == "block":
            self.body += self.buffer
            assert self.call is not None
            self.call.feed(self.buffer)
            self._close_block(self.START + self.body)
        elif self.state == "content" or self.buffer.strip():
            self.out.text(self.buffer)
        self.buffer = ""


class JsonCallsParser(ToolParser):
    """Call objects one after another: after an optional tag and an opening bracket, `{call}`
    separated by `sep`, up to the closing bracket. Output that does not open with a call object is
    content; after the calls, what is not another call is content (whitespace between is dropped)."""

    tag: str | None = None  # optional before the first call
    open: str | None = None  # the opening and closing brackets, when the calls are in a list
    close: str | None = None
    sep = ";"

    def __init__(self, make_id: IdMaker = index_ids) -> None:
        super().__init__(make_id)
        self.state = "prefix"  # -> "object" -> "sep" -> "next" -> "object" ...; "tail"; "content"
        self.buffer = ""  # the prefix until it is decided
        self.head = ""  # text before the first object (content if that object is no call)
        self.object = ""  # the current object's text
        self.extent = Extent()
        self.call: CallScanner | None = None

    def _start(self, text: str) -> int | None:
        """Where the first object starts (its `{`); None: not a list of calls; -1: undecided yet."""
        pos = 0
        for token in (self.tag, self.open, "{"):
            while pos < len(text) and text[pos] in WS:
                pos += 1
            if token is None:
                continue
            rest = text[pos:]
            if rest.startswith(token):
                pos += len(token)
            elif token.startswith(rest):
                return -1
            elif token != self.tag:
                return None
        return pos - 1

    def parse(self, text: str) -> ParsedOutput:
        pos = self._start(text)
        if pos is None or pos < 0:
            return ParsedOutput(text)
        calls: list[tuple[str, str]] = []
        while True:
            end = value_end(text, pos)
            call = call_of(text[pos:] if end is None else text[pos:end])
            if call is None:
                return self._whole(text[pos:] if calls else text, calls)
            calls.append(call)
            rest = "" if end is None else text[end:].lstrip(WS)
            following = rest[1:].lstrip(WS)
            if rest[:1] == self.sep and following[:1] == "{":
                pos = len(text) - len(following)
                continue
            return self._whole(self._tail(rest), calls)

    def _tail(self, rest: str) -> str:
        """The content after the last call, from the first character after it that is not whitespace:
        a separator or closing bracket there is not part of it."""
        if rest[:1] == self.sep or (self.close and rest[:1] == self.close):
            return rest[1:].lstrip(WS)
        return rest

    def _feed(self, text: str) -> None:
        while text:
            text = self._step(text)

    def _step(self, text: str) -> str:
        """Take what `text` decides in the current state; returns what is left for the next one."""
        if self.state == "content":
            self.out.text(text)
            return ""
        if self.state == "prefix":
            return self._prefix(text)
        if self.state == "object":
            return self._object(text)
        rest = text.lstrip(WS)
        if not rest:
            return ""
        if self.state == "sep" and rest[0] == self.sep:
            self.state = "next"
            return rest[1:]
        if self.state == "sep" and self.close and rest[0] == self.close:
            self.state = "tail"
            return rest[1:]
        if self.state == "next" and rest[0] == "{":
            self._new_object()
            return rest
        self.state = "content"
        return rest

    def _prefix(self, text: str) -> str:
        self.buffer += text
        start = self._start(self.buffer)
        if start == -1:
            return ""
        if start is None:
            self.state = "content"
            text, self.buffer = self.buffer, ""
            return text
        self.head, text, self.buffer = self.buffer[:start], self.buffer[start:], ""
        self._new_object()
        return text

    def _new_object(self) -> None:
        self.state, self.object, self.extent = "object", "", Extent()
        self.call = self._call()

    def _object(self, text: str) -> str:
        assert self.call is not None
        _, end = self.extent.feed(text)
        part = text if end is None else text[:end]
        self.object += part
        self.call.feed(part)
        if end is None:
            return ""
        self._close_object()
        return text[end:]

    def _close_object(self) -> None:
        assert self.call is not None
        self.state = "sep"
        if not self.call.close():
            self.calls -= 1
            self.out.text(self.object if self.calls else self.head + self.object)
            self.state = "content"
        self.call = None

    def _finish(self) -> None:
        if self.state == "prefix":  # never decided: all of it was content
            self.out.text(self.buffer)
        elif self.state == "object":
            self._close_object()


class Llama3JsonToolParser(JsonCallsParser):
    name = "llama3_json"
    tag, sep = "<|python_tag|>", ";"


class JsonArrayToolParser(JsonCallsParser):
    """`tool_choice: "required"`: the output is a JSON array of `{"name", "parameters"}` objects. It is
    constrained to that array, so text that is no call is the cut end of one (`max_tokens` ran out
    inside it): dropped, never content (a client would otherwise show `{"name":` as the answer)."""

    name = "json_array"
    open, sep, close = "[", ",", "]"

    def feed(self, text: str, final: bool = False) -> Delta:
        return "", super().feed(text, final)[1]

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput("", super().parse(text).tool_calls)


class NamedToolParser(ToolParser):
    """`tool_choice` naming a function: the whole output is its arguments."""

    name = "named"

    def __init__(self, function: str, make_id: IdMaker = index_ids) -> None:
        super().__init__(make_id)
        self.function = function

    def parse(self, text: str) -> ParsedOutput:
        return self._whole("", [(self.function, text)])

    def _feed(self, text: str) -> None:
        if self.calls == 0:
            self.calls = 1
            self.out.start(0, self.make_id(0), self.function)
        self.out.arguments(0, text)

    def _finish(self) -> None:
        self._feed("")


FAMILIES: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
# What marks each family in a chat template (the first that matches wins).
_MARKS = (("hermes", ("<tool_call>",)), ("llama3_json", ("<|python_tag|>", "<|start_header_id|>")))


def family_of(chat_template: Any) -> str | None:
    """The parser family a checkpoint's chat template writes tool calls in; None when unknown."""
    if isinstance(chat_template, dict):  # named templates (`default`, `tool_use`): any of them
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not isinstance(chat_template, str):
        return None
    return next((family for family, marks in _MARKS if any(m in chat_template for m in marks)), None)
