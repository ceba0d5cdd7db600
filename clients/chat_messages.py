"""The parts of a job for chat and constrained output: `messages`, `tools` and `tool_choice`, checked
and put in the shape chat templates take, and the JSON schemas (and tool-call arguments) that may
nest deeper than the rest of a job (part of the job schema, clients/protocol.py). `bad(message)`
builds the caller's error."""

from __future__ import annotations

import json
import re
from typing import Any

SPEC_MAX_DEPTH = 64  # params.structured_outputs (a JSON schema) is exempt from max_depth, not unbounded
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


def split_schemas(obj: dict[Any, Any]) -> tuple[dict[Any, Any], Any]:
    """The job without its JSON schemas and data (params.structured_outputs, `tools`, the messages'
    `tool_calls`), and those (None when there are none)."""
    params = obj.get("params")
    schemas = {}
    rest = dict(obj)
    if isinstance(params, dict) and "structured_outputs" in params:
        rest["params"] = {k: v for k, v in params.items() if k != "structured_outputs"}
        schemas["structured_outputs"] = params["structured_outputs"]
    if "tools" in rest:
        schemas["tools"] = rest.pop("tools")
    messages = rest.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and "tool_calls" in m for m in messages):
        # Tool-call arguments are JSON objects as deep as their function's schema allows.
        schemas["tool_calls"] = [m.get("tool_calls") for m in messages if isinstance(m, dict)]
        rest["messages"] = [{k: v for k, v in m.items() if k != "tool_calls"} if isinstance(m, dict) else m
                            for m in messages]
    return (rest, schemas) if schemas else (obj, None)


MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def parse_messages(messages: Any, max_messages: int, bad: Any) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: `content` a string or a list of text parts
    (joined), an assistant's `tool_calls` (arguments as objects), a `tool` message's `tool_call_id`."""
    if not isinstance(messages, list) or not messages or len(messages) > max_messages:
        raise bad(f"`messages` must be a list of 1-{max_messages} messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or set(m) - MESSAGE_FIELDS or not isinstance(m.get("role"), str):
            raise bad('each message must be {"role": string, "content": string or text parts} (also '
                      '`name`, an assistant\'s `tool_calls`, a tool result\'s `tool_call_id`)')
        message = dict(m)
        message["content"] = _content(m.get("content"), "tool_calls" in m, bad)
        if "tool_calls" in m:
            message["tool_calls"] = _tool_calls(m["tool_calls"], bad)
        for name in ("name", "tool_call_id"):
            if name in m and not isinstance(m[name], str):
                raise bad(f"a message's `{name}` must be a string")
        out.append(message)
    return out


def _content(content: Any, has_calls: bool, bad: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None and has_calls:  # an assistant turn that only calls tools
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(
            p.get("text"), str) and set(p) <= {"type", "text"} for p in content):
        return "".join(p["text"] for p in content)
    raise bad('a message\'s `content` must be a string or a list of {"type": "text", "text": string} parts')


def _tool_calls(calls: Any, bad: Any) -> list[dict[str, Any]]:
    """[{"id", "type": "function", "function": {"name", "arguments"}}]; arguments given as JSON text
    (as OpenAI sends them) become objects, which is what chat templates render."""
    if not isinstance(calls, list) or not calls:
        raise bad("`tool_calls` must be a non-empty list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or call.get("type", "function") != "function"):
            raise bad('each tool call must be {"type": "function", "function": {"name": string, "arguments": ...}}')
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                # Not strict: a raw control character in a string is what the grammar engine's JSON allows,
                # so an answer's own arguments, sent back with the next turn, are read as they were written.
                args = json.loads(args, strict=False) if args.strip() else {}
            except ValueError:
                raise bad(f"a message's tool call {fn['name']!r}: `arguments` is not JSON") from None
        if not isinstance(args, dict):
            raise bad(f"a message's tool call {fn['name']!r}: `arguments` must be an object (or its JSON text)")
        out.append({**call, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_tools(tools: Any, bad: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > 128:
        raise bad("`tools` must be a list of at most 128 function definitions")
    names: set[str] = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters", {}), dict)):
            raise bad('each tool must be {"type": "function", "function": {"name": string, "description": '
                      'string, "parameters": JSON Schema}}')
        name = fn["name"]
        if not TOOL_NAME.fullmatch(name):  # OpenAI's rule: a call names its tool, and the name must say which
            raise bad(f"tool name {name[:80]!r} must be 1 to 64 letters, digits, underscores or dashes "
                      "(^[a-zA-Z0-9_-]{1,64}$)")
        if name in names:
            raise bad(f"two tools are named {name!r}: each needs a name of its own")
        names.add(name)
    return tools


TOOL_CHOICES = ("auto", "none", "required")


def parse_tool_choice(choice: Any, tools: list[dict[str, Any]] | None, params: dict[str, Any],
                      bad: Any) -> str | dict[str, Any]:
    """`"auto" | "none" | "required" | {"type": "function", "function": {"name": N}}`, as OpenAI's API
    takes it; `required` and a named function constrain the output (so they cannot come with another
    constraint, params.structured_outputs)."""
    if tools is None:
        raise bad("`tool_choice` needs `tools`")
    mode = choice if choice in TOOL_CHOICES else "function"
    if mode == "function":
        name = _named_function(choice)
        if name is None:
            raise bad('`tool_choice` must be "auto", "none", "required" or {"type": "function", "function": '
                      '{"name": string}}')
        if name not in {t["function"]["name"] for t in tools}:
            raise bad(f"`tool_choice` names the function {name!r}, which is not in `tools`")
    if mode == "required" and not tools:
        raise bad('`tool_choice` "required" needs at least one tool in `tools`')
    if mode in ("required", "function") and params.get("structured_outputs") is not None:
        what = '"required"' if mode == "required" else "naming a function"
        raise bad(f"`tool_choice` {what} constrains the output itself: it cannot be combined with "
                  "params.structured_outputs", "invalid_params")
    return choice


def _named_function(choice: Any) -> str | None:
    if not isinstance(choice, dict) or set(choice) != {"type", "function"} or choice["type"] != "function":
        return None
    fn = choice["function"]
    ok = isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str)
    return fn["name"] if ok else None


def merge_tool_call_deltas(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Fold an event's `tool_calls` deltas into a sample's whole calls (OpenAI's message shape:
    `{"id", "type": "function", "function": {"name", "arguments"}}`, arguments as JSON text)."""
    for delta in deltas:
        fn = delta.get("function", {})
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function",
                          "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "")}})
        elif 0 <= delta.get("index", -1) < len(calls):
            calls[delta["index"]]["function"]["arguments"] += fn.get("arguments", "")
