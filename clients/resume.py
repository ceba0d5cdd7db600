"""What a request's event stream says about an earlier run of it: where to continue, with what tokens.

A worker that takes over a job (its first worker died) reads `llm:events:{id}` and resumes from it,
so the client's stream continues at the next seq with no gap and no duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clients.protocol import decode_event, seq_of_stream_id


@dataclass
class ResumeState:
    next_seq: int = 0
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # sample index -> emitted tokens
    finished: bool = False  # a done or error event is already there: nothing left to do but ack

    def resume_token_ids(self, n: int) -> list[list[int]] | None:
        """The engine's `resume_token_ids` argument, or None for a fresh start."""
        if not any(self.token_ids.values()):
            return None
        return [list(self.token_ids.get(k, [])) for k in range(n)]


def resume_state(entries: list[tuple[Any, dict[Any, Any]]]) -> ResumeState:
    """Fold the entries of an events stream (XRANGE output, in order) into a ResumeState."""
    state = ResumeState()
    for stream_id, fields in entries:
        seq = seq_of_stream_id(stream_id)
        if seq != state.next_seq:  # ids are written in order, so this is a foreign or damaged stream
            raise ValueError(f"event stream has seq {seq} where {state.next_seq} was expected")
        event = decode_event(fields)
        state.next_seq = seq + 1
        if event.get("type") in ("done", "error"):
            state.finished = True
        elif event.get("type") == "token":
            state.token_ids.setdefault(int(event["index"]), []).extend(event["token_ids"])
    return state
