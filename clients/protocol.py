"""The Redis wire contract (docs/protocol.md, version 1): key names, job decoding, event encoding.

Pure Python (no torch, no Redis I/O) so that the client, the worker and the gateway share one
definition of the format; its errors are in clients/errors.py. Sampling parameters are only checked
for shape here; the worker checks them against the engine's `SamplingParams.from_dict` when it
runs the job (workers/worker/job.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from clients.chat_messages import SPEC_MAX_DEPTH, parse_messages, parse_tool_choice, parse_tools, split_schemas
from clients.errors import ProtocolError
from clients.job_tasks import parse_task
from clients.names import Names  # noqa: F401  (re-exported: the protocol's names)
from clients.numbers import is_int

VERSION = 1
ENCODINGS = ("json", "msgpack")
JOB_FIELDS = frozenset(
    {"v", "id", "prompt", "prompt_token_ids", "messages", "tools", "tool_choice", "params", "priority", "deadline",
     "tenant", "session", "lora", "traceparent", "task", "options"}
)
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
# https://www.w3.org/TR/trace-context/#traceparent-header (version 00, lower-case hex).
TRACEPARENT_RE = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
# Ids become part of Redis key names and log lines: keep them printable and short.
ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# Tenant names become part of stream names (a tenant's queue, docs/scheduling.md).
TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_SESSION_CHARS = 256
# LoRA adapter names: registered with `streamer lora add` and shown as OpenAI model names (docs/lora.md).
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Limits:
    max_payload_bytes: int = 1 << 20
    max_depth: int = 6  # job map > messages list > message map > content: 4 is all a valid job needs
    max_items: int = 1 << 17  # longest list or map accepted anywhere in a job
    max_messages: int = 1024


@dataclass
class Job:
    """A decoded, shape-checked request."""

    id: str
    encoding: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # function definitions, for the chat template
    tool_choice: str | dict[str, Any] | None = None  # "auto" (None with tools), "none", "required" or a function
    params: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    deadline: int | None = None  # unix ms
    tenant: str = ""  # set by the gateway from the API key ("": none); its share and limits apply
    session: str = ""  # calls of one conversation or agent ("": none): affinity and attained service
    lora: str = ""  # the registered LoRA adapter it runs under ("": the base model)
    traceparent: str = ""  # W3C trace context of the span that submitted it ("": not traced)
    task: str = "generate"  # one of job_tasks.TASKS
    options: dict[str, Any] = field(default_factory=dict)  # the task's options (job_tasks.TASK_OPTIONS)


def event_stream_id(seq: int) -> str:
    """Events are stored under explicit stream ids `0-(seq+1)`: Redis refuses a second write of the same
    seq, which makes every write idempotent (retries after a dropped connection, or two workers resuming
    the same request, can never duplicate an event), and readers resume with `XREAD ... 0-(seq+1)`."""
    return f"0-{seq + 1}"


def seq_of_stream_id(stream_id: str | bytes) -> int:
    if isinstance(stream_id, bytes):
        stream_id = stream_id.decode()
    return int(stream_id.split("-", 1)[1]) - 1


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a decoded payload, stopping as soon as it passes `limit`."""
    return _walk(obj, limit)[0]


def _unicode_ok(text: str) -> bool:
    """False for a string holding a lone surrogate: what a JSON `\\ud800` escape without its pair, or
    bytes that are not UTF-8 (decoded with surrogateescape), become. Such text cannot be encoded
    again (an event, a log line, a tokenizer)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _walk(obj: Any, limit: int) -> tuple[int, bool]:
    """(nesting depth, whether every string is valid Unicode) of a decoded payload; the walk stops as
    soon as the depth passes `limit`. Scalars count as a level: `[[1]]` is 3 deep."""
    stack = [(obj, 1)]
    deepest, text_ok = 0, True
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            children: Any = node.values()
            text_ok = text_ok and all(_unicode_ok(k) for k in node if isinstance(k, str))
        elif isinstance(node, list):
            children = node
        else:
            text_ok = text_ok and (not isinstance(node, str) or _unicode_ok(node))
            continue
        if children:
            deepest = max(deepest, depth + 1)
        if deepest > limit:
            return deepest, text_ok
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
            elif isinstance(child, str) and text_ok:
                text_ok = _unicode_ok(child)
    return deepest, text_ok


# A JSON text's strings (escapes included) and runs of brackets: enough to see its structure without
# decoding it (readable_id).
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]+|[\]}]+')


def readable_id(text: str | bytes) -> str | None:
    """The request id of a JSON object that cannot be decoded whole: nested too deeply for the decoder,
    broken inside a nested value, or too large. Every value nested in the top-level object is replaced
    by `null` (found by bracket counting outside strings) and what is left is decoded; its `id`, when
    valid, is returned. None when the top level itself is broken or the text is not an object: then
    nobody can say which request it was."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="surrogateescape")
    kept: list[str] = []
    depth, start = 0, 0
    for m in _JSON_TOKEN.finditer(text):
        token = m.group()
        if token[0] == '"':
            continue
        if token[0] in "[{":
            if depth <= 1 < depth + len(token):  # this run enters a value nested in the top level
                cut = m.start() + 1 - depth
                kept.append(text[start:cut])
                start = -1
            depth += len(token)
        else:
            if depth - len(token) <= 1 < depth and start == -1:  # back at the top level
                end = m.start() + depth - 1
                kept.append("null")
                start = end
            depth -= len(token)
            if depth < 0:
                return None
    if start == -1 or depth != 0:
        return None
    kept.append(text[start:])
    try:
        top = json.loads("".join(kept))
    except (ValueError, RecursionError):
        return None
    rid = top.get("id") if isinstance(top, dict) else None
    return rid if isinstance(rid, str) and ID_RE.match(rid) else None


def split_fields(fields: dict[Any, Any]) -> tuple[str, bytes]:
    """The one `json` or `msgpack` field of a request-stream entry -> (encoding, raw payload)."""
    decoded = {_text(k): v for k, v in fields.items()}
    present = [k for k in decoded if k in ENCODINGS]
    if len(present) != 1 or len(decoded) != 1:
        raise ProtocolError(
            "bad_encoding",
            f"an entry needs exactly one field, `json` or `msgpack`; got {sorted(map(str, decoded))}",
        )
    raw = decoded[present[0]]
    return present[0], raw.encode() if isinstance(raw, str) else raw


def decode_payload(encoding: str, raw: bytes, limits: Limits = Limits(), *, check_depth: bool = True,
                   text_errors: str = "strict") -> Any:
    """Decode one payload within `limits`. `text_errors="surrogateescape"` (jobs) decodes bytes that are
    not UTF-8 into lone surrogates instead of failing, so that the payload's id can still be read and
    the schema check refuses the text with it (parse_job)."""
    if len(raw) > limits.max_payload_bytes:
        raise ProtocolError(
            "too_large", f"payload is {len(raw)} bytes; the limit is {limits.max_payload_bytes}"
        )
    try:
        if encoding == "json":
            obj = json.loads(raw.decode("utf-8", errors=text_errors))
        else:
            n = limits.max_items
            # Strings and binaries cannot outgrow the payload, already bounded above; ext types are refused.
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_array_len=n, max_map_len=n,
                                  max_ext_len=0, unicode_errors=text_errors)
    except RecursionError as e:  # json: too deeply nested to decode at all
        raise ProtocolError("bad_encoding", "payload is nested too deeply") from e
    except Exception as e:  # any decoder failure is the client's bad bytes, never the worker's crash
        kind = type(e).__name__
        raise ProtocolError("bad_encoding", f"cannot decode {encoding} payload ({kind}: {e})"[:300]) from e
    if check_depth and _depth(obj, limits.max_depth) > limits.max_depth:
        raise ProtocolError("bad_encoding", f"payload is nested deeper than {limits.max_depth} levels")
    return obj


def parse_job(obj: Any, encoding: str, limits: Limits = Limits(), *, tools_parsed: bool = False) -> Job:
    """Check a decoded request map against schema version 1. `tools_parsed`: the caller built `tools`
    and `tool_choice` from what it parsed itself (the gateway's OpenAI parser, which answers in OpenAI's
    errors), so they are taken as they are; whatever reads a job from a client or from Redis leaves it
    off."""
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_request", f"a request must be a map, not {type(obj).__name__}")
    raw_id = obj.get("id")
    request_id = raw_id if isinstance(raw_id, str) and ID_RE.match(raw_id) else None

    def bad(message: str, code: str = "invalid_request") -> ProtocolError:
        return ProtocolError(code, message, request_id)

    if request_id is None:
        raise bad("`id` must be a string of 1-128 characters from A-Z a-z 0-9 . _ : @ / + = -")
    rest, spec = split_schemas(obj)
    depth, text_ok = _walk(rest, limits.max_depth)
    if depth > limits.max_depth:
        raise bad(f"payload is nested deeper than {limits.max_depth} levels", "bad_encoding")
    if spec is not None:  # a JSON schema nests as deep as its data: bounded by size, and this
        spec_depth, spec_text_ok = _walk(spec, SPEC_MAX_DEPTH)
        if spec_depth > SPEC_MAX_DEPTH:
            raise bad(f"a schema (params.structured_outputs, tools, tool_calls) is nested deeper than "
                      f"{SPEC_MAX_DEPTH} levels", "invalid_params")
        text_ok = text_ok and spec_text_ok
    if not text_ok:  # before any message that quotes the job's strings
        raise bad("every string must be valid Unicode: one holds a lone surrogate (an unpaired \\ud800-"
                  "\\udfff escape) or bytes that are not UTF-8")
    unknown = sorted(str(k) for k in obj if k not in JOB_FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {unknown}; allowed: {sorted(JOB_FIELDS)}")
    if obj.get("v") != VERSION or not is_int(obj.get("v")):
        raise bad(f"`v` must be {VERSION} (schema version), got {obj.get('v')!r}", "unsupported_version")
    given = [k for k in PROMPT_FIELDS if k in obj]
    if len(given) != 1:
        raise bad(f"exactly one of {list(PROMPT_FIELDS)} is required, got {given}")
    job = Job(id=request_id, encoding=encoding)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise bad("`prompt` must be a non-empty string")
        job.prompt = obj["prompt"]
    elif "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
            raise bad("`prompt_token_ids` must be a non-empty list of non-negative integers")
        if len(ids) > limits.max_items:
            raise bad(f"`prompt_token_ids` holds {len(ids)} ids; at most {limits.max_items}")
        job.prompt_token_ids = ids
    else:
        job.messages = parse_messages(obj["messages"], limits.max_messages, bad)
    if obj.get("tools") is not None:
        if "messages" not in obj:
            raise bad("`tools` needs `messages` (they are rendered by the chat template)")
        job.tools = obj["tools"] if tools_parsed else parse_tools(obj["tools"], bad)
    params = obj.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise bad("`params` must be a map from field name to value", "invalid_params")
    job.params = params
    if obj.get("tool_choice") is not None:
        job.tool_choice = (obj["tool_choice"] if tools_parsed
                           else parse_tool_choice(obj["tool_choice"], job.tools, params, bad))
    if "priority" in obj:
        if not is_int(obj["priority"]) or abs(obj["priority"]) > 2**31:
            raise bad("`priority` must be an integer from -2**31 to 2**31")
        job.priority = obj["priority"]
    if "deadline" in obj and obj["deadline"] is not None:
        if not is_int(obj["deadline"]) or not 0 <= obj["deadline"] < 2**63:
            raise bad("`deadline` must be a unix time in milliseconds (0 to 2**63-1)")
        job.deadline = obj["deadline"]
    if obj.get("tenant") is not None:
        if not isinstance(obj["tenant"], str) or not TENANT_RE.match(obj["tenant"]):
            raise bad("`tenant` must be 1 to 64 letters, digits, '.', '_' or '-'")
        job.tenant = obj["tenant"]
    if obj.get("session") is not None:
        if not isinstance(obj["session"], str) or not 0 < len(obj["session"]) <= MAX_SESSION_CHARS:
            raise bad(f"`session` must be a non-empty string of at most {MAX_SESSION_CHARS} characters")
        job.session = obj["session"]
    if obj.get("lora") is not None:
        if not isinstance(obj["lora"], str) or not LORA_NAME_RE.match(obj["lora"]):
            raise bad("`lora` must be 1 to 64 letters, digits, '.', '_' or '-'")
        job.lora = obj["lora"]
    if obj.get("traceparent") is not None:
        if not isinstance(obj["traceparent"], str) or not TRACEPARENT_RE.match(obj["traceparent"]):
            raise bad("`traceparent` must be a W3C trace context: 00-<32 hex>-<16 hex>-<2 hex>")
        job.traceparent = obj["traceparent"]
    job.task, job.options = parse_task(obj, given[0], bad)
    return job


def decode_job(fields: dict[Any, Any], limits: Limits = Limits()) -> Job:
    """A request-stream entry's fields -> Job, or ProtocolError (with `request_id` when readable: also
    for a payload nested too deeply, holding text that is not UTF-8, or, in JSON, too large or broken
    only inside a nested value)."""
    encoding, raw = split_fields(fields)
    try:
        obj = decode_payload(encoding, raw, limits, check_depth=False, text_errors="surrogateescape")
    except ProtocolError as e:
        # An oversized payload is only looked into up to a bound: reading it at all is what the limit prevents.
        if encoding == "json" and len(raw) <= 4 * limits.max_payload_bytes:
            e.request_id = readable_id(raw)
        raise
    return parse_job(obj, encoding, limits)


def encode(obj: dict[str, Any], encoding: str) -> bytes:
    if encoding == "json":
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return msgpack.packb(obj, use_bin_type=True)


def encode_job(job: dict[str, Any], encoding: str = "json") -> dict[str, bytes]:
    """Client side: a request map -> the fields of an XADD to the requests stream."""
    return {encoding: encode({"v": VERSION, **job}, encoding)}


def decode_event(fields: dict[Any, Any]) -> dict[str, Any]:
    """Client side: the fields of an events-stream entry -> event map."""
    encoding, raw = split_fields(fields)
    return decode_payload(encoding, raw, Limits(max_payload_bytes=1 << 62, max_depth=8))


def decode_message(data: bytes | str) -> dict[str, Any]:
    """Client side: a pub/sub message (JSON text or msgpack bytes, whichever the request used)."""
    raw = data.encode() if isinstance(data, str) else data
    encoding = "json" if raw[:1] == b"{" else "msgpack"
    return decode_payload(encoding, raw, Limits(max_payload_bytes=1 << 62, max_depth=8))
