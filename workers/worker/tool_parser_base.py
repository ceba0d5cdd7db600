"""What every tool-call parser shares: the parsed output's shape and the streaming base class
(workers/worker/tool_parsers.py lists the formats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.worker.tool_call_json import CallScanner, Deltas, IdMaker, index_ids

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
