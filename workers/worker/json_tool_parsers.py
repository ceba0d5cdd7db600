"""Tool-call formats that are JSON call objects one after another: Llama 3.x's `;`-separated calls
and the JSON array `tool_choice: "required"` constrains the output to (workers/worker/tool_parsers.py)."""

from __future__ import annotations

from workers.worker.tool_call_json import WS, CallScanner, Extent, IdMaker, call_of, index_ids, value_end
from workers.worker.tool_parser_base import Delta, ParsedOutput, ToolParser


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
