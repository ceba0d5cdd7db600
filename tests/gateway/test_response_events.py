"""Job events -> Responses events (workers/gateway/openai/response_events.py), without a stack: the items
a mixed answer makes, in OpenAI's order, and the numbering a replay reproduces exactly."""

from __future__ import annotations

from typing import Any

from workers.gateway.openai.response_events import ResponseEvents

FIXED = {"id": "resp_abc", "object": "response", "model": "m", "background": True}
JOB = [{"type": "token", "seq": 0, "text": "Let me check."},
       {"type": "token", "seq": 1, "text": "", "tool_calls": [
           {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"ci"}}]},
       {"type": "token", "seq": 2, "text": "", "tool_calls": [{"index": 0, "function": {"arguments": "ty\": 1}"}}]},
       {"type": "token", "seq": 3, "text": "Done."},
       {"type": "done", "seq": 4, "finish_reason": "tool_calls",
        "usage": {"prompt_tokens": 7, "completion_tokens": 9, "cached_tokens": 4}}]


def run(job: list[dict[str, Any]]) -> tuple[ResponseEvents, list[dict[str, Any]]]:
    r = ResponseEvents(FIXED)
    events = r.opening()
    for event in job:
        events += r.on_event(event)
    return r, events


def test_text_a_call_and_more_text_make_three_items_in_order() -> None:
    r, events = run(JOB)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None), ("response.queued", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.output_text.delta", 0),
        # the call closes the message before it opens
        ("response.output_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.output_item.added", 2), ("response.content_part.added", 2), ("response.output_text.delta", 2),
        # the end closes what is open, in output order
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_text.done", 2), ("response.content_part.done", 2), ("response.output_item.done", 2),
        ("response.completed", None)]
    obj = r.snapshot()
    assert obj["status"] == "completed"
    assert [i["type"] for i in obj["output"]] == ["message", "function_call", "message"]
    assert obj["output"][1] == {"id": "fc_abc_1", "type": "function_call", "status": "completed", "call_id": "call_1",
                                "name": "get_weather", "arguments": "{\"city\": 1}"}
    assert obj["output"][0]["content"][0]["text"] == "Let me check." and obj["output"][2]["id"] == "msg_abc_2"
    assert obj["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 9,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 16}
    # Snapshots inside events are copies: the created event still shows the empty, queued response.
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["output"] == []
    assert run(JOB)[1] == events  # a replay numbers every event the same


def test_ends_incomplete_cancelled_and_failed() -> None:
    cut = [{"type": "token", "seq": 0, "text": "Hi"}, {"type": "done", "seq": 1, "finish_reason": "length"}]
    r, events = run(cut)
    assert r.status == "incomplete" and r.incomplete == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete" and r.output[0]["status"] == "incomplete"
    r, events = run([{"type": "done", "seq": 0, "finish_reason": "abort"}])
    assert r.status == "cancelled" and events[-1]["type"] == "response.cancelled" and r.output == []
    r, events = run([{"type": "token", "seq": 0, "text": "Hi"},
                     {"type": "error", "seq": 1, "code": "internal", "message": "the step failed"}])
    assert events[-1]["type"] == "response.failed" and r.snapshot()["error"] == {"code": "internal",
                                                                                 "message": "the step failed"}
