"""One response's job events -> OpenAI's Responses stream events and response object (docs/openai.md).

A `ResponseEvents` sees the job's events in `seq` order and returns the Responses events each makes,
numbered by `sequence_number` from 0. The numbering is a function of the job's events alone (never of
time, of which gateway reads them, or of when a client connected), so replaying the durable events
stream from seq 0 on any gateway numbers every event exactly as the first run did: that is what lets
`starting_after=N` resume with no gap and no duplicate after any restart.

Items: text opens an assistant `message` item (its one `output_text` part); a tool call opens a
`function_call` item (closing an open message first); the job's end closes whatever is open, in
output order, and ends the response `completed`, `incomplete` (cut by `max_output_tokens`),
`cancelled` (its job was aborted) or `failed` (the worker's error).
"""

from __future__ import annotations

import copy
from typing import Any

# The event that ends a response, per final status. OpenAI's stream has no event of its own for a
# cancelled response; `response.cancelled` is the name its webhooks give one.
_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.cancelled", "failed": "response.failed"}
FINAL_STATUSES = tuple(_FINAL_EVENT)


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    """A worker's `done` usage in the Responses shape."""
    prompt, output = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseEvents:
    def __init__(self, fixed: dict[str, Any]) -> None:
        """`fixed`: the response object's fields that do not change while it runs (response_input.py)."""
        self.fixed = fixed
        self.key = str(fixed["id"]).removeprefix("resp_")  # item ids follow from it and the output index
        self.status = "queued" if fixed.get("background") else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.open: list[int] = []  # output indexes of items not done yet, in output order
        self.message: int | None = None  # the message item text goes to (None: text opens one)
        self.calls: dict[int, int] = {}  # the worker's call index -> its item's output index
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.next_seq = 0

    @property
    def finished(self) -> bool:
        return self.status in FINAL_STATUSES

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (output so far)."""
        return {**self.fixed, "status": self.status, "output": copy.deepcopy(self.output), "usage": self.usage,
                "error": self.error, "incomplete_details": self.incomplete}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.next_seq, **fields}
        self.next_seq += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        """What every stream of this response starts with, before any job event."""
        first = self._event("response.created", response=self.snapshot())
        kind = "response.queued" if self.status == "queued" else "response.in_progress"
        return [first, self._event(kind, response=self.snapshot())]

    def on_event(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if self.status == "queued":  # its first job event: a worker runs it
            self.status = "in_progress"
            out.append(self._event("response.in_progress", response=self.snapshot()))
        kind = event.get("type")
        if kind == "token":
            if event.get("text"):
                out += self._text(str(event["text"]))
            for call in event.get("tool_calls") or []:
                out += self._call(call)
            return out
        if kind == "done":
            reason = event.get("finish_reason")
            self.usage = usage_of(event.get("usage") or {})
            if reason == "length":
                self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                self.status = "cancelled" if reason == "abort" else "completed"
        else:  # an error event (or one this gateway cannot read): the response failed
            self.status = "failed"
            self.error = {"code": str(event.get("code", "internal")), "message": str(event.get("message", ""))}
        item_status = "completed" if self.status == "completed" else "incomplete"
        for index in list(self.open):
            out += self._close(index, item_status)
        out.append(self._event(_FINAL_EVENT[self.status], response=self.snapshot()))
        return out

    # --- items -------------------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        index = len(self.output)
        self.output.append(item)
        self.open.append(index)
        return index, self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self.message is None:
            index, added = self._add({"id": f"msg_{self.key}_{len(self.output)}", "type": "message",
                                      "role": "assistant", "status": "in_progress", "content": []})
            self.message = index
            self.output[index]["content"].append(_part(""))
            out += [added, self._event("response.content_part.added", item_id=self.output[index]["id"],
                                       output_index=index, content_index=0, part=_part(""))]
        item = self.output[self.message]
        item["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self.message,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        number = int(delta.get("index", 0))
        function = delta.get("function") or {}
        if number not in self.calls:  # the delta that opens a call carries its id and name
            if self.message is not None:  # text before a call is a message of its own
                out += self._close(self.message, "completed")
            index, added = self._add({"id": f"fc_{self.key}_{len(self.output)}", "type": "function_call",
                                      "status": "in_progress", "call_id": str(delta.get("id", "")),
                                      "name": str(function.get("name", "")), "arguments": ""})
            self.calls[number] = index
            out.append(added)
        index = self.calls[number]
        arguments = str(function.get("arguments") or "")
        if arguments:
            self.output[index]["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                                   output_index=index, delta=arguments))
        return out

    def _close(self, index: int, status: str) -> list[dict[str, Any]]:
        item = self.output[index]
        self.open.remove(index)
        out = []
        if item["type"] == "message":
            self.message = None if self.message == index else self.message
            text = item["content"][0]["text"]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=_part(text))]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return out
