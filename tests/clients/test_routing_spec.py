"""The prefix chain as docs/scheduling.md specifies it, for submitters in any language: segments (each
chat message as the chat template receives it and the tool definitions, as canonical JSON; a plain
prompt in whole 256-character chunks; token ids in whole 64-id chunks), hashes chained with BLAKE2b
of 8 bytes, each segment weighted in estimated tokens (4 characters a token). The reference below is
a transcription of that text, written apart from clients/routing.py: another client computing it
must get the same digests, or its jobs are never routed to the worker holding their prefix."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from clients.routing import MAX_SEGMENTS, Segment, answer_chain, prefix_chain


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def chained(pieces: list[tuple[str, int]]) -> list[Segment]:
    out, prev, total = [], b"", 0
    for text, tokens in pieces[:64]:
        # UTF-8; a lone surrogate (a JSON `\ud800` escape, which the worker refuses later) is encoded
        # as its three bytes rather than making the submitter fail.
        prev = hashlib.blake2b(prev + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        total += tokens
        out.append(Segment(prev.hex(), total))
    return out


def reference(job: dict[str, Any]) -> list[Segment]:
    if "messages" in job:
        pieces = [(canonical(job["tools"]), len(canonical(job["tools"])) // 4)] if job.get("tools") else []
        pieces += [(canonical(m), max(1, len(canonical(m)) // 4)) for m in job["messages"]]
        return chained(pieces)
    if "prompt_token_ids" in job:
        ids = job["prompt_token_ids"]
        return chained([(",".join(map(str, ids[i:i + 64])), 64) for i in range(0, len(ids) // 64 * 64, 64)])
    text = job["prompt"]
    return chained([(text[i:i + 256], 64) for i in range(0, len(text) // 256 * 256, 256)])


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
JOBS = {
    "chat": {"messages": [{"role": "system", "content": "Sé breve. " * 40}, {"role": "user", "content": "Hi"}]},
    "chat with tools": {"tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Oslo?"}]},
    "short message": {"messages": [{"role": "user", "content": ""}]},  # weighs at least 1 token
    "prompt": {"prompt": "ab" * 400},  # 800 characters: 3 whole chunks, 32 left over
    "prompt of one chunk": {"prompt": "c" * 256},
    "prompt under a chunk": {"prompt": "c" * 255},
    "token ids": {"prompt_token_ids": list(range(200))},  # 3 whole chunks
    "token ids of one chunk": {"prompt_token_ids": list(range(64))},
    "token ids under a chunk": {"prompt_token_ids": list(range(63))},
    "very long prompt": {"prompt": "".join(chr(97 + i % 26) for i in range(256 * 70))},  # capped at 64
    "lone surrogates": {"prompt": "\ud800" * 256},
}


@pytest.mark.parametrize("name", list(JOBS))
def test_the_chain_is_the_documented_encoding(name: str) -> None:
    chain = prefix_chain(JOBS[name])
    assert chain == reference(JOBS[name])
    assert all(type(s.tokens) is int for s in chain)  # whole tokens, as a worker adds them up


def test_the_chain_is_capped_and_jobs_without_input_have_none() -> None:
    assert len(prefix_chain(JOBS["very long prompt"])) == MAX_SEGMENTS == 64
    assert prefix_chain({"messages": [{"role": "user", "content": "x"}] * 70})[-1].tokens == 64 * max(1, len(
        canonical({"role": "user", "content": "x"})) // 4)
    assert prefix_chain({}) == [] and prefix_chain({"prompt": None}) == []


def test_messages_are_hashed_as_the_chat_template_receives_them() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert prefix_chain(parts) == reference({"messages": [{"role": "user", "content": "ab"}]})
    broken = {"messages": [{"role": "nobody"}]}  # a job the worker refuses: hashed as given, not a crash
    assert prefix_chain(broken) == reference(broken)


def test_an_answered_turn_extends_the_chain_and_a_plain_prompt_has_no_answer_chain() -> None:
    job = JOBS["chat"]
    assert answer_chain(job, "Hola") == reference(
        {"messages": [*job["messages"], {"role": "assistant", "content": "Hola"}]})
    assert answer_chain(JOBS["prompt"], "more") == []
