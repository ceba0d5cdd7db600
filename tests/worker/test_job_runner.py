"""A job's path through the worker (workers/worker/job.py) at each edge the engine can put it on: a full
queue (the job waits, still ours), a spec or prompt the engine refuses, an error output with and without
its own code, a stream that ends unfinished, an engine that dies; and what the worker itself decides
before the engine sees the job (deadlines, cancels, the checkpoint's defaults, a chat template that is
missing) and writes after (usage, finish reasons, log-prob texts). The engine is scripted
(tests/scripted_engine.py); Redis and the worker are real."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import anyio
import pytest
import redis
from redis_worker_helpers import check_complete, dead_letters, has_ended, read_events, wait_for
from scripted_engine import ScriptedEngine, answer, output, sample, scripted_worker
from test_worker_deliveries import push_delivered

from clients.events import done_event, token_event
from clients.loras import encode_entry
from clients.protocol import Names, encode, encode_job, event_stream_id
from clients.redis_client import AsyncClient
from clients.routing import answer_chain, prefix_chain
from streamer.errors import EngineDeadError, GrammarError, QueueFullError
from streamer.lora import LoRARequest
from streamer.prompts import TokenizedPrompt
from workers.worker.redis_worker import Worker

NAMES = Names()
GREEDY = {"max_tokens": 8, "temperature": 0.0}
TWO = {"max_tokens": 8, "temperature": 1.0, "n": 2}  # two samples


async def served(engine: ScriptedEngine, redis_url: str, *jobs: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each job (AsyncClient.submit's arguments) served to its end by a worker on `engine`: its events."""
    async with scripted_worker(engine, redis_url) as worker, AsyncClient(redis_url) as client:
        ids = [await client.submit(**{"params": GREEDY, **job}) for job in jobs]
        await wait_for(lambda: all(has_ended(redis_url, rid) for rid in ids), timeout=10)
        await wait_for(lambda: worker.stats()["jobs"] == 0, timeout=5)  # what its heartbeat says it holds
    return [read_events(redis_url, rid) for rid in ids]


def error_of(events: list[dict[str, Any]]) -> tuple[str, str]:
    end = check_complete(events)
    assert end["type"] == "error", end
    return end["code"], end["message"]


# The waits between an engine's refusals for a full queue: from 50 ms, doubling, at most a second.
BACKOFF_S = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


@pytest.mark.anyio
async def test_a_full_queue_delays_the_job_and_the_engine_takes_it_later(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [*[[QueueFullError("full")]] * len(BACKOFF_S), answer("ab", (1, 2))]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "waits"})
    assert [(e["id"], e["type"], e["token_ids"], e["text"]) for e in events] == [
        ("waits", "token", [1], "a"), ("waits", "token", [2], "b"), ("waits", "done", [], "")]
    assert len(engine.calls) == len(BACKOFF_S) + 1 and engine.aborted == []  # refused, never dropped
    waits = [b.at - a.at for a, b in zip(engine.calls, engine.calls[1:])]
    assert all(want <= wait < want + 0.3 for want, wait in zip(BACKOFF_S, waits, strict=True)), waits
    assert dead_letters(redis_url) == []


@pytest.mark.anyio
@pytest.mark.parametrize(("raised", "code"), [(GrammarError("bad regex '('"), "invalid_params"),
                                               (ValueError("prompt too long: 99 > 64"), "invalid_request")])
async def test_a_job_the_engine_refuses_is_answered_with_its_reason(redis_url: str, raised: Exception,
                                                                     code: str) -> None:
    engine = ScriptedEngine({"p": [[raised]]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "refused"})
    assert error_of(events) == (code, str(raised))
    assert engine.aborted == [] and len(engine.calls) == 1
    assert dead_letters(redis_url) == []  # the client's own mistake: no operator's dead letter


@pytest.mark.anyio
async def test_an_error_output_ends_the_job_with_the_engines_code_or_internal(redis_url: str) -> None:
    engine = ScriptedEngine({
        "own": [[output(sample(0, "a", [1])), output(error="grammar over its budget", error_code="invalid_params")]],
        "engine": [[output(error="step failed")]],
    })
    own, other = await served(engine, redis_url, {"prompt": "own", "id": "own"}, {"prompt": "engine", "id": "eng"})
    assert [e["type"] for e in own] == ["token", "error"] and own[0]["token_ids"] == [1]
    assert error_of(own) == ("invalid_params", "grammar over its budget")
    assert error_of(other) == ("internal", "the engine could not run this request: step failed")
    # Only the engine's fault is kept for the operator.
    assert [(d["id"], d["reason"]) for d in dead_letters(redis_url)] == [(b"eng", b"internal")]
    assert sorted(engine.closed) == ["eng", "own"]


@pytest.mark.anyio
async def test_a_stream_that_ends_unfinished_is_an_internal_error(redis_url: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    engine = ScriptedEngine({"p": [[output(sample(0, "a", [1]))]]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "cut"})
    assert error_of(events) == ("internal", "worker error: engine stream ended without a finished output")
    assert events[0]["token_ids"] == [1]
    [letter] = dead_letters(redis_url)
    assert (letter["id"], letter["reason"]) == (b"cut", b"internal") and b'"cut"' in letter["payload_json"]
    assert f"request cut (entry {letter['entry'].decode()}) failed" in caplog.messages


@pytest.mark.anyio
async def test_an_engine_that_dies_stops_the_worker_and_leaves_the_job_for_another(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = ScriptedEngine({"p": [[EngineDeadError("step loop crashed")]]})
    r = redis.Redis.from_url(redis_url)
    with pytest.raises(BaseException) as raised:  # the task group wraps it
        async with scripted_worker(engine, redis_url) as worker, AsyncClient(redis_url) as client:
            await client.submit("p", id="orphan", params=GREEDY)
            with anyio.fail_after(10):
                while not worker.stopping:
                    await anyio.sleep(0.02)
    assert "worker stopped: the engine failed (step loop crashed)" in repr(raised.value)
    assert "request orphan: engine is dead (step loop crashed); stopping this worker" in caplog.messages
    assert read_events(redis_url, "orphan") == []
    assert dead_letters(redis_url) == []
    assert r.xpending(NAMES.requests, NAMES.group)["pending"] == 1  # unacked: another worker resumes it
    r.close()


@pytest.mark.anyio
async def test_a_deadline_passed_before_the_start_never_reaches_the_engine(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [[0.01, *answer()]]})  # the engine's first output takes a moment
    past = int(time.time() * 1000) - 1000
    [late, ok] = await served(engine, redis_url, {"prompt": "p", "id": "late", "deadline": past},
                              {"prompt": "p", "id": "ok", "deadline": past + 60_000})
    assert error_of(late) == ("expired", "the deadline passed before the job started")
    assert check_complete(ok)["type"] == "done"
    assert [c.request_id for c in engine.calls] == ["ok"]


@pytest.mark.anyio
async def test_a_deadline_that_passes_while_the_engine_queues_the_job_aborts_it(redis_url: str) -> None:
    engine = ScriptedEngine({"slow": [[3.0, *answer()]]})
    async with scripted_worker(engine, redis_url), AsyncClient(redis_url) as client:
        deadline = int(time.time() * 1000) + 400
        await client.submit("slow", id="slow", deadline=deadline, params=GREEDY)
        await wait_for(lambda: has_ended(redis_url, "slow"), timeout=10)
    assert error_of(read_events(redis_url, "slow")) == ("expired", "the deadline passed before the job started")
    assert engine.aborted == ["slow"]
    assert 0 <= engine.aborted_at["slow"] * 1000 - deadline < 450  # at the deadline, not at the first output


@pytest.mark.anyio
async def test_a_job_cancelled_before_it_was_read_ends_aborted_without_running(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [answer()]})
    async with AsyncClient(redis_url) as client:
        await client.submit("p", id="gone", params=TWO)
        await client.cancel("gone")
        async with scripted_worker(engine, redis_url) as worker:
            await client.submit("p", id="after", params=GREEDY)
            await wait_for(lambda: has_ended(redis_url, "gone") and has_ended(redis_url, "after"), timeout=10)
            assert samples(worker, "vllm:request_success_total", finished_reason="abort") == 2  # per sample
    end = check_complete(read_events(redis_url, "gone"))
    assert (end["type"], end["id"], end["finish_reasons"]) == ("done", "gone", ["abort", "abort"])
    assert end["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    assert [c.request_id for c in engine.calls] == ["after"]


@pytest.mark.anyio
async def test_the_done_event_counts_every_sample_and_names_unfinished_ones_abort(redis_url: str) -> None:
    # Sample 1 never reports a finish reason: it is "abort". Sample 2 arrives only in the last output
    # (as beams do): it is counted even though n is 2.
    engine = ScriptedEngine({"p": [[
        output(sample(0, "a", [1]), sample(1, "x", [4])),
        output(sample(0, "b", [2], "stop"), sample(2, "yz", [5, 6], "length"), finished=True, cached=2),
    ]]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "n", "params": TWO})
    end = check_complete(events)
    assert end["finish_reasons"] == ["stop", "abort", "length"]
    assert end["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 2}
    assert [(e["index"], e["token_ids"]) for e in events[:-1]] == [(0, [1]), (1, [4]), (0, [2]), (2, [5, 6])]


@pytest.mark.anyio
async def test_log_prob_pairs_carry_each_tokens_text(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [[output(sample(0, "a", [1], "stop", logprobs=[{1: -0.5, 9: -1.5}]),
                                           finished=True)]]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "lp", "params": {**GREEDY, "logprobs": 1}})
    token = events[0]
    assert token["logprobs"] == [[[1, -0.5], [9, -1.5]]]
    assert token["logprob_texts"] == [["<1>", "<9>"]]


@pytest.mark.anyio
async def test_the_engine_gets_the_jobs_priority_session_and_params_over_the_checkpoints(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [answer()]}, defaults={"temperature": 0.7, "top_k": 3})
    engine.scripts["ids:9,8"] = [answer()]
    await served(engine, redis_url, {"prompt": "p", "id": "j", "priority": -3, "session": "chat-1",
                                     "params": {"temperature": 0.5, "max_tokens": 5}},
                 {"prompt_token_ids": [9, 8], "id": "ids"})
    call, by_ids = engine.calls
    assert by_ids.prompt == {"prompt_token_ids": [9, 8]}
    assert (call.request_id, call.priority, call.session, call.resume_token_ids) == ("j", -3, "chat-1", None)
    assert (call.params.temperature, call.params.top_k, call.params.max_tokens) == (0.5, 3, 5)
    assert call.prompt == "p" and call.lora_request is None


@pytest.mark.anyio
async def test_a_chat_job_without_a_chat_template_is_an_invalid_request(redis_url: str) -> None:
    engine = ScriptedEngine({})
    [events] = await served(engine, redis_url, {"messages": [{"role": "user", "content": "hi"}], "id": "chat"})
    assert error_of(events) == ("invalid_request", "this checkpoint has no chat template")
    assert engine.calls == []


@pytest.mark.anyio
async def test_checkpoint_defaults_that_do_not_hold_are_invalid_params(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [answer()]}, defaults={"top_p": 7.0})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "bad"})
    code, message = error_of(events)
    assert code == "invalid_params" and "top_p" in message
    assert engine.calls == []


@pytest.mark.anyio
async def test_a_job_whose_worker_died_as_it_entered_the_engine_runs_alone_once(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Its previous attempt entered the engine (the record in its fence hash, attempts.py) and wrote
    nothing since. In company, it runs again, alone; alone, it is what kills workers: not handed on."""
    caplog.set_level(logging.WARNING, logger="streamer.worker")
    r = redis.Redis.from_url(redis_url)
    for rid, alone in (("crowd", 0), ("lone", 1)):
        r.hset(NAMES.fence(rid), mapping={"epoch": 1, "started": 1, "seq": 0, "alone": alone})
    engine = ScriptedEngine({"p": [[0.5, *answer()]], "q": [answer()]})  # its first output takes 0.5 s
    crowd, lone, _ = await served(engine, redis_url, {"prompt": "p", "id": "crowd"}, {"prompt": "p", "id": "lone"},
                                  {"prompt": "q", "id": "other"})
    assert check_complete(crowd)["type"] == "done"
    # Alone: the job pushed after it enters the engine only once the suspect has its first output.
    assert [c.request_id for c in engine.calls] == ["crowd", "other"]
    assert engine.calls[1].at - engine.calls[0].at >= 0.5
    assert error_of(lone) == ("crashed_worker", "the job was running alone in the engine when its worker died, "
                              "before any output: it is not handed to another worker")
    assert r.hget(NAMES.fence("crowd"), "alone") == b"1"  # this attempt is on record as a lone one
    assert [(d["id"], d["reason"]) for d in dead_letters(redis_url)] == [(b"lone", b"crashed_worker")]
    assert "request crowd: its worker died while it entered the engine; running it alone" in caplog.messages
    r.close()


@pytest.mark.anyio
async def test_a_jobs_lora_adapter_is_read_from_the_registry(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.hset(NAMES.loras, "sql", encode_entry("/adapters/sql"))
    engine = ScriptedEngine({"p": [answer()]})
    known, unknown = await served(engine, redis_url, {"prompt": "p", "id": "known", "lora": "sql"},
                                  {"prompt": "p", "id": "unknown", "lora": "nope"})
    assert check_complete(known)["type"] == "done"
    assert [c.lora_request for c in engine.calls] == [LoRARequest("sql", "/adapters/sql")]
    assert error_of(unknown) == ("invalid_request", "unknown LoRA adapter 'nope': register it with "
                                 "`streamer lora add NAME PATH` (see `streamer lora list`)")
    r.close()


@pytest.mark.anyio
async def test_the_max_th_delivery_runs_and_the_next_is_answered_too_many(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    push_delivered(r, "one-too-many", 2)  # its third delivery is ours
    push_delivered(r, "last-chance", 1)
    engine = ScriptedEngine({"hi": [answer()]})
    async with scripted_worker(engine, redis_url, claim_idle_s=0.3, max_deliveries=2):
        await wait_for(lambda: has_ended(redis_url, "one-too-many") and has_ended(redis_url, "last-chance"), 10)
    assert error_of(read_events(redis_url, "one-too-many")) == (
        "too_many_deliveries", "job was delivered 3 times without finishing")
    assert check_complete(read_events(redis_url, "last-chance"))["type"] == "done"
    assert [c.request_id for c in engine.calls] == ["last-chance"]
    assert r.xpending(NAMES.requests, NAMES.group)["pending"] == 0
    r.close()


@pytest.mark.anyio
async def test_a_second_job_with_a_used_id_is_a_dead_letter_and_the_first_runs(redis_url: str) -> None:
    engine = ScriptedEngine({"first": [answer()], "second": [answer()]})
    [events, _] = await served(engine, redis_url, {"prompt": "first", "id": "dup"}, {"prompt": "second", "id": "dup"})
    assert check_complete(events)["type"] == "done" and len(events) == 3  # the first one's, once
    assert [c.prompt for c in engine.calls] == ["first"]
    [letter] = dead_letters(redis_url)
    assert (letter["id"], letter["reason"], letter["message"]) == (
        b"dup", b"duplicate_id", b"id 'dup' is already used by another request")
    assert b'"second"' in letter["payload_json"]  # the job that was refused, kept for the operator
    r = redis.Redis.from_url(redis_url)
    assert r.xpending(NAMES.requests, NAMES.group)["pending"] == 0  # both acked
    r.close()


@pytest.mark.anyio
async def test_a_job_answered_before_is_only_acked(redis_url: str) -> None:
    """Its worker wrote `done` and died before its ack: the entry is handed out again, and nothing runs."""
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    done = done_event("answered", 0, ["stop"], {"prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0})
    r.xadd(NAMES.events("answered"), {"json": encode(done, "json")}, id=event_stream_id(0))
    push_delivered(r, "answered", 1)
    engine = ScriptedEngine({"hi": [answer()]})
    async with scripted_worker(engine, redis_url, claim_idle_s=0.3):
        await wait_for(lambda: r.xpending(NAMES.requests, NAMES.group)["pending"] == 0, timeout=10)
    assert read_events(redis_url, "answered") == [done]
    assert engine.calls == [] and dead_letters(redis_url) == []
    r.close()


@pytest.mark.anyio
async def test_a_task_other_than_generate_is_answered_without_generating(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({})
    async with scripted_worker(engine, redis_url):
        r.xadd(NAMES.requests, encode_job({"id": "count", "task": "tokenize", "prompt": "abc"}))
        await wait_for(lambda: has_ended(redis_url, "count"), timeout=10)
    end = check_complete(read_events(redis_url, "count"))
    assert (end["type"], end["result"]["count"]) == ("done", 3)
    assert engine.calls == []
    r.close()


@pytest.mark.anyio
async def test_an_unexpected_engine_failure_aborts_the_request_and_answers_internal(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [[RuntimeError("kernel bug")]]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "bug"})
    assert error_of(events) == ("internal", "worker error: kernel bug")
    assert engine.aborted == ["bug"]  # never left running unwatched
    assert [(d["id"], d["reason"]) for d in dead_letters(redis_url)] == [(b"bug", b"internal")]


@pytest.mark.anyio
async def test_a_job_that_does_not_validate_is_answered_with_its_code(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({})
    async with scripted_worker(engine, redis_url):
        r.xadd(NAMES.requests, encode_job({"id": "bad", "prompt": ["not", "text"]}))
        await wait_for(lambda: has_ended(redis_url, "bad"), timeout=10)
    code, _ = error_of(read_events(redis_url, "bad"))
    assert code == "invalid_request" and engine.calls == [] and dead_letters(redis_url) == []
    r.close()


CHAT = [{"role": "user", "content": "hi"}]
# Two samples, two tokens each: "ab" and "xy".
TWO_SAMPLES: list[Any] = [output(sample(0, "a", [1]), sample(1, "x", [4])),
                          output(sample(0, "b", [2], "length"), sample(1, "y", [5], "length"), finished=True)]


def samples(worker: Worker, name: str, **labels: str) -> float:
    """The sum of a worker metric's samples of that name (and those labels), as /metrics shows them."""
    return sum(s.value for metric in worker.metrics.registry.collect() for s in metric.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def left_by_a_dead_worker(r: redis.Redis, rid: str, token_ids: list[int], text: str, **job: Any) -> None:
    """A job whose worker wrote its first token event, then died: the next delivery resumes it."""
    r.xadd(NAMES.events(rid), {"json": encode(token_event(rid, 0, 0, token_ids, text), "json")},
           id=event_stream_id(0))
    with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: made for an earlier one
        r.xgroup_create(NAMES.requests, NAMES.group, id="0", mkstream=True)
    r.xadd(NAMES.requests, encode_job({"id": rid, "params": GREEDY, **job}))
    r.xreadgroup(NAMES.group, "dead-0", {NAMES.requests: ">"})


@pytest.mark.anyio
async def test_the_workers_metrics_count_each_job_once_and_a_resumed_one_without_its_first_token(
        redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    left_by_a_dead_worker(r, "resumed", [1], "a", prompt="r")
    engine = ScriptedEngine({"r": [answer("bc", (2, 3))], "p": [TWO_SAMPLES], "bad": [[output(error="step failed")]]})
    async with scripted_worker(engine, redis_url, claim_idle_s=0.3) as worker, AsyncClient(redis_url) as client:
        await wait_for(lambda: has_ended(redis_url, "resumed"), timeout=10)
        resumed = {k: samples(worker, k) for k in ("vllm:time_to_first_token_seconds_count",
                                                   "vllm:generation_tokens_total")}
        await client.submit("p", id="fresh", params=TWO)
        await client.submit("bad", id="bad", params=TWO)
        await wait_for(lambda: has_ended(redis_url, "fresh") and has_ended(redis_url, "bad"), timeout=10)
        assert engine.calls[0].resume_token_ids == [[1]]
        # Its first token was counted by the worker that wrote it: only the rest here, and no TTFT.
        assert resumed == {"vllm:time_to_first_token_seconds_count": 0, "vllm:generation_tokens_total": 2}
        assert samples(worker, "vllm:time_to_first_token_seconds_count") == 1  # the fresh one's
        assert samples(worker, "vllm:generation_tokens_total") == 2 + 4
        assert samples(worker, "vllm:request_success_total", finished_reason="error") == 2  # one per sample
        assert samples(worker, "vllm:request_success_total", finished_reason="length") == 1 + 2
    r.close()


@pytest.mark.anyio
async def test_a_chat_answer_is_advertised_as_the_next_turns_prefix_unless_resumed(redis_url: str) -> None:
    """The worker's cache holds the answer's KV too: its chain extended by the answer as the next turn
    sends it is advertised for routing (accounting.py). A resumed job's text here is only part of it."""
    r = redis.Redis.from_url(redis_url)
    earlier = [{"role": "user", "content": "an earlier question"}]
    left_by_a_dead_worker(r, "resumed", [1], "a", messages=earlier, session="s-2")
    engine = ScriptedEngine({"ids:5,6,7": [TWO_SAMPLES]}, render=lambda m: TokenizedPrompt([5, 6, 7]))
    async with scripted_worker(engine, redis_url, claim_idle_s=0.3, consumer="me"), \
            AsyncClient(redis_url) as client:
        await wait_for(lambda: has_ended(redis_url, "resumed"), timeout=10)
        await client.submit(messages=CHAT, id="fresh", params=TWO, session="s-1")
        await wait_for(lambda: has_ended(redis_url, "fresh"), timeout=10)
        answered = {s.digest for s in answer_chain({"messages": CHAT}, "ab")}  # the first sample's
        asked = {s.digest for m in (CHAT, earlier) for s in prefix_chain({"messages": m})}
        # Exactly these: the resumed job's chain extended by its part here is not among them.
        advertised = lambda: {d.decode() for d in r.smembers(NAMES.worker_prefixes("me"))}  # noqa: E731
        with anyio.move_on_after(10):  # flushed every FLUSH_S
            while advertised() != answered | asked:
                await anyio.sleep(0.05)
        assert advertised() == answered | asked  # while it serves: a worker that leaves takes them back
    r.close()


WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.anyio
async def test_tool_calls_are_read_from_the_stream_and_end_with_tool_calls(redis_url: str) -> None:
    text = "Sure.\n" + CALL
    cut = [text[:9], text[9:40], text[40:]]
    engine = ScriptedEngine({"ids:5,6,7": [[
        output(sample(0, cut[0], [1])), output(sample(0, cut[1], [2])),
        output(sample(0, cut[2], [3], "stop"), finished=True)]]}, render=lambda m: TokenizedPrompt([5, 6, 7]))
    async with scripted_worker(engine, redis_url, tool_call_parser="hermes"), AsyncClient(redis_url) as client:
        await client.submit(messages=CHAT, tools=WEATHER_TOOL, id="calls", params=GREEDY)
        await wait_for(lambda: has_ended(redis_url, "calls"), timeout=10)
    assert engine.rendered == [(CHAT, WEATHER_TOOL)]  # the functions go into the template
    events = read_events(redis_url, "calls")
    assert "".join(e["text"] for e in events) == "Sure.\n"
    calls = [c for e in events for c in e.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"city": "Oslo"}
    assert check_complete(events)["finish_reasons"] == ["tool_calls"]


@pytest.mark.anyio
async def test_a_finished_output_without_samples_ends_each_sample_aborted(redis_url: str) -> None:
    engine = ScriptedEngine({"p": [[output(finished=True)]]})
    [events] = await served(engine, redis_url, {"prompt": "p", "id": "empty"})
    end = check_complete(events)
    assert (end["type"], end["id"], end["finish_reasons"]) == ("done", "empty", ["abort"])
    assert end["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0}


@pytest.mark.anyio
async def test_a_tenants_service_is_what_its_jobs_really_cost(redis_url: str) -> None:
    """Charged a flat amount when taken (streams.py), corrected at the end to its prompt and output
    tokens: the fair share holds in tokens (accounting.py)."""
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({"p": [answer("ab", (1, 2))]})
    service = lambda: float(r.hget(NAMES.service, "acme") or 0)  # noqa: E731
    async with scripted_worker(engine, redis_url), AsyncClient(redis_url) as client:
        await client.submit("p", id="t", tenant="acme", params=GREEDY)
        await wait_for(lambda: has_ended(redis_url, "t"), timeout=10)
        with anyio.move_on_after(5):
            while service() != 5:
                await anyio.sleep(0.05)
    assert service() == 5  # 3 prompt tokens + 2 generated
    queues = r.zrange(NAMES.streams, 0, -1)  # the tenant's queue among them: acked where it was taken
    assert queues and all(r.xpending(q, NAMES.group)["pending"] == 0 for q in queues)
    r.close()


@pytest.mark.anyio
async def test_a_jobs_entry_stays_pending_until_its_last_event_is_written(redis_url: str) -> None:
    """Acked only at the end: a worker that dies mid-job leaves it for another to resume."""
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({"p": [[output(sample(0, "a", [1])), 30.0, *answer()]]})
    async with scripted_worker(engine, redis_url), AsyncClient(redis_url) as client:
        await client.submit("p", id="long", params=GREEDY)
        await wait_for(lambda: len(read_events(redis_url, "long")) == 1, timeout=10)
        await anyio.sleep(0.3)  # its first event's write has long been confirmed
        assert r.xpending(NAMES.requests, NAMES.group)["pending"] == 1
        await client.cancel("long")
        await wait_for(lambda: has_ended(redis_url, "long"), timeout=10)
    assert check_complete(read_events(redis_url, "long"))["finish_reasons"] == ["abort"]
    assert r.xpending(NAMES.requests, NAMES.group)["pending"] == 0
    r.close()


@pytest.mark.anyio
async def test_an_embed_job_enters_the_engine_on_record_and_can_be_cancelled_there(redis_url: str) -> None:
    """Like generation: its attempt recorded before the engine (attempts.py), cancellable while the
    engine has it, and a cancel read with it answers it without the engine."""
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({"v": [[output(finished=True, embedding=[0.5, -0.5])]], "slow": [[30.0]]})
    async with AsyncClient(redis_url) as client:
        entry = r.xadd(NAMES.requests, encode_job({"id": "early", "task": "embed", "prompt": "v"}))
        r.set(NAMES.job("early"), entry)  # its id claimed, as a submit does: it can be cancelled
        await client.cancel("early")
        async with scripted_worker(engine, redis_url):
            for rid, prompt in (("vec", "v"), ("stuck", "slow")):
                r.xadd(NAMES.requests, encode_job({"id": rid, "task": "embed", "prompt": prompt}))
            await wait_for(lambda: has_ended(redis_url, "vec") and [c for c in engine.calls if c.prompt == "slow"],
                           timeout=10)
            await client.cancel("stuck")
            await wait_for(lambda: has_ended(redis_url, "stuck") and has_ended(redis_url, "early"), timeout=10)
    vec = check_complete(read_events(redis_url, "vec"))
    assert (vec["type"], vec["result"]["embedding"], vec["usage"]["prompt_tokens"]) == ("done", [0.5, -0.5], 3)
    assert r.hget(NAMES.fence("vec"), "started") == r.hget(NAMES.fence("vec"), "epoch") == b"1"
    for rid in ("stuck", "early"):
        end = check_complete(read_events(redis_url, rid))
        assert (end["type"], end["id"], end["finish_reasons"]) == ("done", rid, ["abort"]), rid
    assert check_complete(read_events(redis_url, "early"))["usage"] == {
        "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    assert engine.aborted == ["stuck"] and sorted(c.request_id for c in engine.calls) == ["stuck", "vec"]
    r.close()


@pytest.mark.anyio
async def test_text_a_tool_parser_held_back_goes_out_at_the_end_and_nothing_empty_does(redis_url: str) -> None:
    """"<tool" may begin a call: the parser holds it until the sample ends, then sends it as text, in an
    event of its own when the last output brings no token. An output that adds nothing sends nothing."""
    engine = ScriptedEngine({"ids:5,6,7": [[output(sample(0, "Hi <tool", [1])), output(sample(0, "", [], "stop"),
                                                                                       finished=True)]]},
                            render=lambda m: TokenizedPrompt([5, 6, 7]))
    async with scripted_worker(engine, redis_url, tool_call_parser="hermes"), AsyncClient(redis_url) as client:
        await client.submit(messages=CHAT, tools=WEATHER_TOOL, id="held", params=GREEDY)
        await wait_for(lambda: has_ended(redis_url, "held"), timeout=10)
    events = read_events(redis_url, "held")
    assert [(e["type"], e["token_ids"], e["text"]) for e in events] == [
        ("token", [1], "Hi "), ("token", [], "<tool"), ("done", [], "")]
    assert check_complete(events)["finish_reasons"] == ["stop"]


@pytest.mark.anyio
async def test_an_output_that_adds_nothing_to_a_tool_job_sends_nothing(redis_url: str) -> None:
    engine = ScriptedEngine({"ids:5,6,7": [[output(sample(0, "Hi", [1])), output(sample(0, "", [])),
                                            output(sample(0, "", [], "stop"), finished=True)]]},
                            render=lambda m: TokenizedPrompt([5, 6, 7]))
    async with scripted_worker(engine, redis_url, tool_call_parser="hermes"), AsyncClient(redis_url) as client:
        await client.submit(messages=CHAT, tools=WEATHER_TOOL, id="quiet", params=GREEDY)
        await wait_for(lambda: has_ended(redis_url, "quiet"), timeout=10)
    assert [(e["type"], e["text"]) for e in read_events(redis_url, "quiet")] == [("token", "Hi"), ("done", "")]


HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


@pytest.mark.anyio
async def test_a_resumed_tool_job_goes_on_inside_the_call_its_last_worker_began(redis_url: str) -> None:
    """Its parser is brought to where the text already sent left it (the engine says what that text was),
    so the rest of the call is read as the call's arguments. The family comes from the chat template
    (`--tool-call-parser auto`). A job with `tool_choice: none` has no parser to bring along."""
    r = redis.Redis.from_url(redis_url)
    began = 'Sure.\n<tool_call>\n{"name": "get_weather", '
    for rid, choice in (("calls", "auto"), ("plain", "none")):
        left_by_a_dead_worker(r, rid, [1, 2], "Sure.\n", messages=CHAT, tools=WEATHER_TOOL, tool_choice=choice)
    rest = '"arguments": {"city": "Oslo"}}\n</tool_call>'
    engine = ScriptedEngine({"ids:5,6,7": [[output(sample(0, rest, [3], "stop"), finished=True)]]},
                            template=HERMES_TEMPLATE, render=lambda m: TokenizedPrompt([5, 6, 7]),
                            texts={((5, 6, 7), (1, 2)): began})
    async with scripted_worker(engine, redis_url, claim_idle_s=0.3):
        await wait_for(lambda: has_ended(redis_url, "calls") and has_ended(redis_url, "plain"), timeout=10)
    assert [c.resume_token_ids for c in engine.calls] == [[[1, 2]]] * 2
    calls = read_events(redis_url, "calls")[1:]  # the events written here
    assert "".join(e["text"] for e in calls) == ""
    assert json.loads("".join(c["function"].get("arguments") or "" for e in calls
                              for c in e.get("tool_calls") or [])) == {"city": "Oslo"}
    assert check_complete(calls)["finish_reasons"] == ["tool_calls"]
    plain = read_events(redis_url, "plain")[1:]
    assert [(e["type"], e["text"]) for e in plain] == [("token", rest), ("done", "")]


@pytest.mark.anyio
async def test_a_resumed_job_runs_to_its_end_past_its_deadline(redis_url: str) -> None:
    """The deadline is for starting: a job that started before it (its first token is out) is finished."""
    r = redis.Redis.from_url(redis_url)
    left_by_a_dead_worker(r, "started", [1], "a", prompt="r", deadline=int(time.time() * 1000) - 1000)
    engine = ScriptedEngine({"r": [[0.05, *answer("bc", (2, 3))]]})  # its next token takes a moment
    async with scripted_worker(engine, redis_url, claim_idle_s=0.3):
        await wait_for(lambda: has_ended(redis_url, "started"), timeout=10)
    events = read_events(redis_url, "started")
    assert check_complete(events)["type"] == "done" and "".join(e["text"] for e in events) == "abc"
    r.close()


@pytest.mark.anyio
async def test_a_tenants_failed_job_costs_nothing_and_frees_its_slot(redis_url: str) -> None:
    """A job the worker fails on is answered: its tenant's slot is free again and the flat charge taken
    with it is given back (accounting.py)."""
    r = redis.Redis.from_url(redis_url)
    engine = ScriptedEngine({"p": [[output(sample(0, "a", [1]))]]})  # ends unfinished: an internal error
    service = lambda: r.hget(NAMES.service, "acme")  # noqa: E731
    async with scripted_worker(engine, redis_url), AsyncClient(redis_url) as client:
        r.zadd(NAMES.tenant_active("acme"), {"t": 2**50})  # its slot, as the gateway's admission takes it
        await client.submit("p", id="t", tenant="acme", params=GREEDY)
        await wait_for(lambda: has_ended(redis_url, "t"), timeout=10)
        with anyio.move_on_after(5):
            while service() is None or float(service()) != 0 or r.zcard(NAMES.tenant_active("acme")):
                await anyio.sleep(0.05)
    assert error_of(read_events(redis_url, "t"))[0] == "internal"
    assert float(service() or -1) == 0 and r.zcard(NAMES.tenant_active("acme")) == 0
    r.close()
