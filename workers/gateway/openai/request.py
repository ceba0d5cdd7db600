"""OpenAI request bodies -> protocol v1 jobs (docs/openai.md).

`/v1/completions` and `/v1/chat/completions` bodies are checked field by field, as OpenAI checks them
(an unknown or unsupported field is a 400 naming it, never silently dropped), and become one job per
prompt, whose `params` the engine's own `SamplingParams` validates (admission.check_job, as for /ws
jobs) before anything is pushed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clients.chat_messages import parse_tool_choice, parse_tools
from clients.numbers import is_int, is_number
from workers.gateway.admission import MAX_TOKENS_LIMIT

MAX_PROMPTS = 64  # prompts in one completions request (each is a job)

# Sampling fields that map 1:1 onto params (OpenAI's, then vLLM's extra ones).
_PARAMS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "n", "top_k", "min_p",
           "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "include_stop_str_in_output")
_COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "user", "priority", "logit_bias",
           *_PARAMS}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls", "store", "metadata"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# What a message may carry besides its role and content: an assistant's calls, a tool result's call id.
_MESSAGE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class OpenAIRequest:
    kind: str  # "chat" or "completion"
    model: str
    stream: bool
    include_usage: bool
    n: int
    top_logprobs: int | None  # logprobs asked for: how many alternatives per token (None: none)
    # per job: {"prompt": str} / {"prompt_token_ids": [...]} / {"messages": [...], "tools", "tool_choice"}
    prompts: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    user: str | None = None  # OpenAI's end-user id: the jobs' `session` unless X-Session-Id says otherwise
    encoding_format: str | None = None  # embeddings: "float" or "base64" (openai/embeddings.py)


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def check_fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    """A JSON object of only `allowed` fields, naming a model (OpenAI's errors otherwise)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in sorted(body):
        if name not in allowed:
            raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("you must provide a model parameter (a string)", "model", "missing_required_parameter")
    return body


def _unsupported(body: dict[str, Any], name: str, ok: Any) -> None:
    """A field streamer accepts only at its no-op value (anything else would be silently wrong)."""
    if name in body and body[name] is not None and not ok(body[name]):
        raise bad(f"`{name}` = {body[name]!r} is not supported by this server", name, "unsupported_parameter")


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("`stream` must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise bad("`stream_options` is only allowed when `stream` is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad("`stream_options` must be an object with `include_usage`", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("`stream_options.include_usage` must be a boolean", "stream_options")
    return True, include


def _sampling(body: dict[str, Any], max_tokens_name: str, default_max: int | None) -> dict[str, Any]:
    params = {k: body[k] for k in _PARAMS if body.get(k) is not None}
    max_tokens = body.get(max_tokens_name, body.get("max_tokens"))
    if max_tokens is not None and (not is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT):
        raise bad(f"`{max_tokens_name}` must be an integer from 1 to {MAX_TOKENS_LIMIT}", max_tokens_name)
    params["max_tokens"] = default_max if max_tokens is None else max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("`stop` must be a non-empty string or a list of them", "stop")
        params["stop"] = stop
    # Types and ranges are the engine's to check (admission.check_job, naming the parameter); only
    # what OpenAI bounds tighter than the engine is checked here.
    temperature = params.get("temperature", 0)
    if not is_number(temperature) or not 0 <= temperature <= 2:
        raise bad("`temperature` must be a number between 0 and 2", "temperature")
    return params


def _priority(body: dict[str, Any]) -> int | None:
    priority = body.get("priority")
    if priority is not None and (not is_int(priority) or abs(priority) > 2**31):
        raise bad("`priority` must be an integer from -2**31 to 2**31 (lower runs first)", "priority")
    return priority


def _base(body: dict[str, Any]) -> dict[str, Any]:
    _unsupported(body, "logit_bias", lambda v: v == {})
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("`user` must be a string", "user")
    return body


def parse_completion(raw: Any) -> OpenAIRequest:
    body = _base(check_fields(raw, COMPLETION_FIELDS))
    _unsupported(body, "echo", lambda v: v is False)
    _unsupported(body, "suffix", lambda v: v == "")
    stream, include_usage = _stream_options(body)
    params = _sampling(body, "max_tokens", 16)  # OpenAI's default for completions
    _unsupported(body, "best_of", lambda v: v == params.get("n", 1))
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not is_int(logprobs) or not 0 <= logprobs <= 20:
            raise bad("`logprobs` must be an integer from 0 to 20", "logprobs")
        params["logprobs"] = logprobs
    return OpenAIRequest("completion", body["model"], stream, include_usage, params.get("n", 1), logprobs,
                         _prompts(body.get("prompt")), params, _priority(body), body.get("user"))


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("`prompt` must be a string, a list of strings, a list of token ids or a list of such lists",
                  "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str) and p:
            out.append({"prompt": p})
        elif isinstance(p, list) and p and all(is_int(t) and t >= 0 for t in p):
            out.append({"prompt_token_ids": p})
        else:
            raise bad("each prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    return out


def parse_chat(raw: Any) -> OpenAIRequest:
    body = _base(check_fields(raw, CHAT_FIELDS))
    _unsupported(body, "store", lambda v: v is False)
    stream, include_usage = _stream_options(body)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _sampling(body, name, None)  # no limit given: until the context is full, as OpenAI
    top = _chat_logprobs(body)
    if top is not None:
        params["logprobs"] = top
    spec = _response_format(body.get("response_format"))
    if spec is not None:
        params["structured_outputs"] = spec
    chat = {"messages": _messages(body.get("messages")), **_tools(body, params)}
    return OpenAIRequest("chat", body["model"], stream, include_usage, params.get("n", 1), top, [chat], params,
                         _priority(body), body.get("user"))


def _tools(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`tools` and `tool_choice` as the job's own fields (docs/structured_outputs.md): the worker reads
    or constrains the calls. No tools (or `[]`) with `tool_choice` absent or "none" is a plain chat."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools and choice in (None, "none"):
        return {}
    if tools is None:
        raise bad("`tool_choice` is only allowed when `tools` are given", "tool_choice")
    fields = {"tools": parse_tools(tools, lambda message, code=None: bad(message, "tools"))}
    if choice is not None:
        fields["tool_choice"] = parse_tool_choice(choice, tools, params,
                                                  lambda message, code=None: bad(message, "tool_choice"))
    return fields


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as the engine's structured_outputs (None: plain text)."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("`response_format.json_schema` must be an object with a `schema` object",
                      "response_format")
        return {"json": spec.get("schema", {})}
    raise bad("`response_format.type` must be text, json_object or json_schema", "response_format")


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("`logprobs` must be a boolean", "logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= 20:
            raise bad("`top_logprobs` must be an integer from 0 to 20", "top_logprobs")
        if not wanted:
            raise bad("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    return (top or 0) if wanted else None


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("`messages` must be a non-empty list", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(f"{param} must be an object with a `role`", param)
    role = _ROLES.get(m["role"])
    if role is None:
        raise bad(f"{param}: role {m['role']!r} is not supported (use system, developer, user, assistant or tool)",
                  f"{param}.role")
    extra = sorted(set(m) - {"role", "content", "name", *_MESSAGE_FIELDS.get(role, ())})
    if extra:
        raise bad(f"{param}: unsupported field(s) {extra}", f"{param}.{extra[0]}", "unsupported_parameter")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise bad(f"{param}: a tool message needs the `tool_call_id` it answers", f"{param}.tool_call_id")
    message: dict[str, Any] = {"role": role, "content": _content(content, param)}
    # Checked, and put in the shape chat templates take, with the job (clients/chat_messages.py).
    message.update({k: m[k] for k in _MESSAGE_FIELDS.get(role, ()) if m.get(k) is not None})
    return message


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                          f"{param}.content")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts
    raise bad(f"{param}.content must be a string or a list of text parts", f"{param}.content")
