"""A job's tool calls (docs/structured_outputs.md): what its `tool_choice` constrains the output to, and
one parser per sample turning the engine's text into content and tool-call deltas for its events.

  none          tools rendered, the output is never read as calls
  auto          (the default with tools) read with the checkpoint's parser family, when it has one
  required      constrained to a JSON array of 1+ `{"name": <a tool>, "parameters": <its schema>}`
  a function    constrained to that function's parameters schema: the whole output is its arguments
"""

from __future__ import annotations

import hashlib
from typing import Any

from clients.protocol import Job
from streamer.structured_outputs import DATA_KEYWORDS, SCHEMA_MAPS
from workers.worker.tool_parsers import FAMILIES, JsonArrayToolParser, NamedToolParser, ToolParser, family_of

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: omitted = none


def call_id(request_id: str, sample: int, call: int) -> str:
    """The same on every worker: a resumed job names its calls as its first run did."""
    return "call_" + hashlib.sha256(f"{request_id}\0{sample}\0{call}".encode()).hexdigest()[:24]


def family(setting: str, chat_template: Any) -> str | None:
    """The parser family for `auto`: the worker's --tool-call-parser, or the chat template's."""
    if setting == "none":
        return None
    return family_of(chat_template) if setting == "auto" else setting


def _function_name(choice: Any) -> str | None:
    return choice["function"]["name"] if isinstance(choice, dict) else None


def _parameters(tool: dict[str, Any]) -> Any:
    return tool["function"].get("parameters", NO_PARAMETERS)


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One or more calls, each naming one of the tools with arguments valid against its schema. Each
    schema moves under the array's `$defs` (`tool_0`, ...), its root-relative `$ref`s with it: inside
    the array, `#` is no longer the tool's own root."""
    defs = {f"tool_{i}": _moved(_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]}, "parameters": {"$ref": f"#/$defs/tool_{i}"}}}
             for i, t in enumerate(tools)]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "$defs": defs}


def _moved(schema: Any, root: str) -> Any:
    """`schema` with every root-relative `$ref` (`#`, `#/...`) pointing under `root` instead."""
    if isinstance(schema, list):
        return [_moved(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = root + value[1:]
        elif key in SCHEMA_MAPS and isinstance(value, dict):  # names mapped to schemas: any name is a name
            moved[key] = {name: _moved(s, root) for name, s in value.items()}
        else:
            moved[key] = value if key in DATA_KEYWORDS else _moved(value, root)
    return moved


def constraint(job: Job) -> dict[str, Any] | None:
    """The structured_outputs spec `tool_choice` puts on the output (None: unconstrained)."""
    if job.tools is None:
        return None
    if job.tool_choice == "required":
        return {"json": required_schema(job.tools)}
    name = _function_name(job.tool_choice)
    if name is None:
        return None
    tool = next(t for t in job.tools if t["function"]["name"] == name)  # the protocol checked it is there
    return {"json": _parameters(tool)}


def sampling_params(job: Job) -> dict[str, Any]:
    """The job's params, with the constraint of its tool_choice (the protocol refused one that also
    has params.structured_outputs)."""
    spec = constraint(job)
    return job.params if spec is None else {**job.params, "structured_outputs": spec}


class ToolCalls:
    """The parsers of one job's samples (built as samples first produce text)."""

    def __init__(self, job: Job, family_name: str | None) -> None:
        self.request_id = job.id
        self.function = _function_name(job.tool_choice)
        self.required = job.tool_choice == "required"
        self.family = family_name
        self.parsers: dict[int, ToolParser] = {}

    @classmethod
    def for_job(cls, job: Job, family_name: str | None) -> ToolCalls | None:
        """None when the job's output is not read as calls."""
        if job.tools is None or job.tool_choice == "none":
            return None
        if job.tool_choice in (None, "auto") and family_name not in FAMILIES:
            return None  # a checkpoint whose format is unknown: its output stays text
        return cls(job, family_name)

    def _parser(self, sample: int) -> ToolParser:
        parser = self.parsers.get(sample)
        if parser is None:
            make_id = lambda i: call_id(self.request_id, sample, i)
            if self.function is not None:
                parser = NamedToolParser(self.function, make_id)
            elif self.required:
                parser = JsonArrayToolParser(make_id)
            else:
                parser = FAMILIES[self.family or ""](make_id)
            self.parsers[sample] = parser
        return parser

    def feed(self, sample: int, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """A sample's new text -> (content, tool-call deltas); `finished`: it was its last."""
        return self._parser(sample).feed(text, final=finished)

    def replay(self, sample: int, text: str) -> None:
        """A resumed job: bring the sample's parser to where the text already sent left it (what it
        hands out was in the events already)."""
        self._parser(sample).feed(text)

    def finish_reason(self, sample: int, reason: str) -> str:
        """`tool_calls` for a sample that stopped after making calls (a cut one keeps `length`); a
        named function's call ends with `stop`, as OpenAI ends a forced call."""
        parser = self.parsers.get(sample)
        made_calls = parser is not None and bool(parser.calls)
        return "tool_calls" if reason == "stop" and made_calls and self.function is None else reason
