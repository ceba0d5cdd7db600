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

from typing import Any

from workers.worker.json_tool_parsers import JsonArrayToolParser, JsonCallsParser, Llama3JsonToolParser
from workers.worker.tool_call_json import CallScanner, IdMaker, call_of, held_back, index_ids
from workers.worker.tool_parser_base import Delta, ParsedOutput, ToolCall, ToolParser

__all__ = ["FAMILIES", "Delta", "HermesToolParser", "JsonArrayToolParser", "JsonCallsParser", "Llama3JsonToolParser",
           "NamedToolParser", "ParsedOutput", "ToolCall", "ToolParser", "family_of"]


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
