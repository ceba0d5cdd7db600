"""What a job asks of a worker (its `task`, docs/protocol.md) and that task's `options`, checked for
clients/protocol.py's parse_job: text generated (the default), its prompt's tokens counted or decoded
(vLLM's /tokenize and /detokenize) or its prompt's embedding (/v1/embeddings), the last three answered
with one `done` event holding a `result`. `bad(message)` builds the caller's error."""

from __future__ import annotations

from typing import Any

from clients.numbers import is_int

TASKS = ("generate", "tokenize", "detokenize", "embed")
POOLINGS = ("last", "mean")
# Each task's options and what each takes: bool, a positive int, or one of a tuple of strings.
TASK_OPTIONS: dict[str, dict[str, Any]] = {
    "generate": {}, "detokenize": {},
    "tokenize": dict.fromkeys(("add_special_tokens", "add_generation_prompt", "continue_final_message",
                               "return_token_strs"), bool),
    "embed": {"pooling": POOLINGS, "normalize": bool, "dimensions": int}}


def parse_task(obj: dict[str, Any], prompt_field: str, bad: Any) -> tuple[str, dict[str, Any]]:
    """The job map's (task, options); `prompt_field`: the one of prompt, prompt_token_ids and messages
    the job has."""
    task = obj.get("task", "generate")
    if task not in TASKS:
        raise bad(f"`task` must be one of {list(TASKS)}")
    options = obj.get("options") or {}
    if not isinstance(options, dict):
        raise bad("`options` must be a map from option name to value")
    allowed = TASK_OPTIONS[task]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise bad(f"unknown option(s) {unknown} for task {task!r}; allowed: {sorted(allowed)}")
    for name, value in options.items():
        _check_option(name, value, allowed[name], bad)
    if task == "tokenize" and prompt_field == "prompt_token_ids":
        raise bad("a tokenize job takes `prompt` or `messages`")
    if task == "detokenize" and prompt_field != "prompt_token_ids":
        raise bad("a detokenize job takes `prompt_token_ids`")
    if task == "embed" and prompt_field == "messages":
        raise bad("an embed job takes `prompt` or `prompt_token_ids`")
    return task, options


def _check_option(name: str, value: Any, kind: Any, bad: Any) -> None:
    if kind is bool and not isinstance(value, bool):
        raise bad(f"option `{name}` must be a boolean")
    if kind is int and (not is_int(value) or value < 1):
        raise bad(f"option `{name}` must be a positive integer")
    if isinstance(kind, tuple) and value not in kind:
        raise bad(f"option `{name}` must be one of {list(kind)}")
