"""`POST /v1/responses` bodies (docs/openai.md#responses-api) -> the chat request they mean.

A Responses request is a chat request in another shape: its `input` items (and, with
`previous_response_id`, the stored conversation before them) become chat messages, `instructions` a
system message, `text.format` the chat `response_format`, `tools` and `tool_choice` the chat ones. The
chat body built here goes through the chat endpoint's own parser (request.parse_chat), so every field
is checked, and every job built, exactly as for `/v1/chat/completions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clients.protocol import MAX_SESSION_CHARS
from workers.gateway.openai.request import OpenAIError, OpenAIRequest, bad, check_fields, parse_chat

# Passed to the chat parser under the same name (vLLM's extra sampling fields included).
_SAME = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "user",
         "parallel_tool_calls")
FIELDS = {"model", "input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "stream", "store",
          "background", "previous_response_id", "metadata", "truncation", "include", "prompt_cache_key",
          "reasoning", "service_tier", *_SAME}
# The chat parser's names for what a Responses client calls otherwise (so a 400 names the client's field).
_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    chat: OpenAIRequest  # what runs: the chat request the Responses body means
    fixed: dict[str, Any]  # the response object's fields that do not change while it runs (less its id)
    items: list[dict[str, Any]]  # the conversation so far: stored input items + this request's input
    stream: bool
    store: bool
    background: bool
    cache_key: str | None  # prompt_cache_key: the jobs' session


def parse_responses(raw: Any, earlier: list[dict[str, Any]]) -> ResponsesRequest:
    """The request, its input after `earlier` (the previous response's items and output, [] without
    one). OpenAIError for anything OpenAI or the chat endpoint would refuse."""
    body = check_fields(raw, FIELDS)
    flags = {name: _flag(body, name, default) for name, default in (("stream", False), ("store", True),
                                                                    ("background", False))}
    if flags["background"] and not flags["store"]:
        raise bad("`background` responses must be stored: `store` cannot be false", "store")
    for name, ok in (("truncation", ("disabled", "auto")), ("service_tier", ("auto", "default"))):
        if body.get(name) is not None and body[name] not in ok:
            raise bad(f"`{name}` = {body[name]!r} is not supported by this server", name, "unsupported_parameter")
    for name in ("include", "reasoning"):
        if body.get(name) not in (None, [], {}):
            raise bad(f"`{name}` is not supported by this server", name, "unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("`instructions` must be a string", "instructions")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad("`metadata` must be an object of at most 16 string values", "metadata")
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not (isinstance(cache_key, str) and 0 < len(cache_key) <= MAX_SESSION_CHARS):
        raise bad(f"`prompt_cache_key` must be a string of 1 to {MAX_SESSION_CHARS} characters", "prompt_cache_key")
    items = [*earlier, *_input_items(body.get("input"))]
    messages = [{"role": "system", "content": instructions}] if instructions else []
    chat_body: dict[str, Any] = {"model": body["model"], "messages": [*messages, *to_messages(items)]}
    chat_body.update({k: body[k] for k in _SAME if body.get(k) is not None})
    if body.get("max_output_tokens") is not None:
        chat_body["max_completion_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise bad("`text` must be an object with a `format`", "text")
        chat_body["response_format"] = _format(text.get("format"))
    tools = body.get("tools")
    if tools:
        chat_body["tools"] = [_tool(t, i) for i, t in enumerate(tools if isinstance(tools, list) else [None])]
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = _tool_choice(body["tool_choice"])
    try:
        chat = parse_chat(chat_body)
    except OpenAIError as e:
        name = (e.param or "").partition("[")[0]
        e.param = _PARAM_NAMES.get(name, e.param)
        raise
    fixed = {"object": "response", "model": body["model"], "instructions": instructions,
             "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
             "top_p": body.get("top_p"), "text": {"format": (text or {}).get("format") or {"type": "text"}},
             "tools": tools or [], "tool_choice": body.get("tool_choice") or "auto",
             "parallel_tool_calls": body.get("parallel_tool_calls", True), "background": flags["background"],
             "store": flags["store"], "previous_response_id": body.get("previous_response_id"),
             "metadata": metadata or {}, "user": body.get("user"), "truncation": "disabled", "reasoning": None}
    return ResponsesRequest(chat, fixed, items, flags["stream"], flags["store"], flags["background"], cache_key)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"`{name}` must be a boolean", name)
    return value


def _input_items(value: Any) -> list[dict[str, Any]]:
    """`input` as a list of items: a string is one user message."""
    if isinstance(value, str) and value:
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("`input` must be a non-empty string or a non-empty list of items", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad(f"input[{i}] must be an object", f"input[{i}]")
    return value


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items -> chat messages; consecutive function calls are one assistant message's calls."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind, param = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), param)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(x, str) for x in (call["id"], item.get("name"), item.get("arguments"))):
                raise bad(f"{param}: a function_call needs string `call_id`, `name` and `arguments`", param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise bad(f"{param}: a function_call_output needs string `call_id` and `output`", param)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise bad(f"{param}: items of type {kind!r} are not supported (message, function_call, "
                      "function_call_output)", f"{param}.type", "unsupported_parameter")
    return messages


def _text(content: Any, param: str) -> Any:
    """A message's content with OpenAI's input_text/output_text parts as the chat's text parts (the
    chat parser checks the rest and names anything else)."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        else:
            raise bad(f"{param}.content: only text parts (input_text, output_text) are supported",
                      f"{param}.content", "unsupported_parameter")
    return parts


def _format(value: Any) -> Any:
    """`text.format` -> the chat `response_format` (its schema fields sit one level up)."""
    if isinstance(value, dict) and value.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in value.items() if k != "type"}}
    return value


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad(f"tools[{i}]: only function tools are supported", f"tools[{i}]", "unsupported_parameter")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
