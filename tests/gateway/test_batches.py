"""The OpenAI Batch API (`/v1/files`, `/v1/batches`) against a live stack: a real redis-server, a real
worker (tiny Llama), gateways on uvicorn, driven by the official `openai` SDK as a user calls it."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import redis.asyncio as aioredis
from docs_examples import run_docs_example
from redis_worker_helpers import NAMES, kill_all, running_worker, worker_process
from rich.console import Console
from test_gateway import config

from clients.names import BATCH_LANE_RANK, BATCH_PRIORITY, DEFAULT_LANE_RANK, Names
from clients.routing import lane_route
from clients.streams import parse_registry
from workers.cli.top_data import Gatherer
from workers.cli.top_view import render
from workers.gateway.keys_file import TenantLimits
from workers.gateway.server import running_gateway
from workers.redis_server import RedisServer

CHAT = "/v1/chat/completions"


def sdk(gw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "v1", api_key="none", max_retries=0, timeout=60)


def chat_lines(model: str, count: int, max_tokens: int = 8) -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
             "body": {"model": model, "messages": [{"role": "user", "content": f"Count to {i}, please."}],
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(count)]


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 300.0) -> list[Any]:
    """Every state of the batch seen while polling it to its end (the last one is the end)."""
    seen = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        seen.append(batch)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return seen
        assert loop.time() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.05)


async def until(check: Any, timeout: float, interval: float = 0.05) -> None:
    """Wait for an async check to hold."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(interval)


async def output(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in (await client.files.content(file_id)).text.splitlines()]


def answers(lines: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """custom_id -> what a greedy run must reproduce (ids and timestamps left out)."""
    return {x["custom_id"]: (x["response"]["status_code"], x["response"]["body"]["choices"],
                             x["response"]["body"]["usage"]) for x in lines}


@pytest.mark.anyio
async def test_files_and_a_chat_batch_as_the_sdk_sees_them(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    lines = chat_lines(model, 12)
    async with running_worker(llama_ckpt, redis_url), \
            running_gateway(config(redis_url, max_file_bytes=16 * 1024)) as gw, sdk(gw) as client:
        # Files: upload, retrieve, list, content; past the bound a 413.
        up = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        assert up.object == "file" and up.purpose == "batch" and up.bytes == len(jsonl(lines))
        assert up.filename == "in.jsonl" and up.expires_at is not None and up.expires_at > up.created_at
        assert (await client.files.retrieve(up.id)).bytes == up.bytes
        assert up.id in [f.id async for f in client.files.list()]
        assert (await client.files.content(up.id)).content == jsonl(lines)
        with pytest.raises(openai.APIStatusError) as too_big:
            await client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 20000)), purpose="batch")
        assert too_big.value.status_code == 413 and "16384 bytes" in too_big.value.message

        batch = await client.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h",
                                            metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.request_counts.total == 12
        assert batch.metadata == {"job": "nightly"} and batch.expires_at == batch.created_at + 24 * 3600
        seen = await finished(client, batch.id)
        done = seen[-1]
        assert done.status == "completed", done
        assert done.request_counts.completed == 12 and done.request_counts.failed == 0
        assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
        counts = [b.request_counts.completed for b in seen]
        assert counts == sorted(counts)  # request_counts only move forward
        assert "in_progress" in {b.status for b in seen}

        out = await output(client, done.output_file_id)
        assert [x["custom_id"] for x in out] == [line["custom_id"] for line in lines]  # every line, once
        for x, line in zip(out, lines):
            assert x["error"] is None and x["response"]["status_code"] == 200
            body = x["response"]["body"]
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
            # Each line's answer is the live endpoint's answer to the same body.
            live = await client.chat.completions.create(**{k: v for k, v in line["body"].items() if k != "ignore_eos"},
                                                        extra_body={"ignore_eos": True})
            assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert (await client.files.retrieve(done.output_file_id)).purpose == "batch_output"
        assert batch.id in [b.id async for b in client.batches.list()]

        # The lines waited in the batch lane, read after every interactive lane.
        r = aioredis.Redis.from_url(redis_url)
        try:
            assert await r.zscore(NAMES.streams, f"{NAMES.requests}:batch") == BATCH_LANE_RANK
        finally:
            await r.aclose()

        deleted = await client.files.delete(up.id)
        assert deleted.deleted and deleted.id == up.id
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(up.id)


@pytest.mark.anyio
async def test_invalid_lines_fail_the_batch_and_cancel_ends_it(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        bad = chat_lines(model, 3)
        bad[1]["body"]["temperature"] = 7
        bad[2]["custom_id"] = "req-0"
        up = await client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(bad) + b"not json\n")), purpose="batch")
        failed = await client.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h")
        assert failed.status == "failed" and failed.failed_at is not None
        assert failed.errors is not None
        assert [(e.line, e.param) for e in failed.errors.data] == [(2, "temperature"), (3, "custom_id"), (4, None)]
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(input_file_id=up.id, endpoint="/v1/moderations", completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")

        # Long lines: cancelled while they run; the unfinished ones end in the error file.
        lines = chat_lines(model, 40, max_tokens=400)
        up = await client.files.create(file=("long.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await client.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h")
        await until(lambda: _status(client, batch.id, "in_progress"), timeout=30)
        # `streamer top` lists it with its counts (the second refresh reads the batches the first found).
        top = Gatherer(redis.Redis.from_url(redis_url), NAMES, redis_url)
        top.snapshot()
        rows = top.snapshot()["batches"]
        assert [(b["id"], b["status"], b["endpoint"], b["total"]) for b in rows] == [
            (batch.id, "in_progress", CHAT, 40)]
        assert "in_progress" in _rendered(top.snapshot())
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        end = (await finished(client, batch.id))[-1]
        assert end.status == "cancelled" and end.cancelled_at is not None
        assert end.request_counts.completed + end.request_counts.failed == 40
        errors = await output(client, end.error_file_id)
        assert errors and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
        outs = await output(client, end.output_file_id) if end.output_file_id else []
        assert sorted(x["custom_id"] for x in [*outs, *errors]) == sorted(x["custom_id"] for x in lines)
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(failed.id)


def _rendered(snap: dict[str, Any]) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(snap))
    return console.export_text()


async def _status(client: openai.AsyncOpenAI, batch_id: str, status: str) -> bool:
    return (await client.batches.retrieve(batch_id)).status == status


@pytest.mark.anyio
async def test_a_batch_survives_gateway_worker_and_redis_restarts(llama_ckpt: Path, tmp_path: Path) -> None:
    """Two gateways: one creates the batch, the other answers for it; the first is stopped mid-batch,
    the worker is SIGKILLed, Redis (AOF) restarts, a fresh gateway and worker start; the output has every
    custom_id once, each answer as in an uninterrupted run (greedy)."""
    model = str(llama_ckpt)
    total = 120
    lines = chat_lines(model, total, max_tokens=32)
    with RedisServer(appendonly=True) as server:
        url = server.url
        async with running_worker(llama_ckpt, url), running_gateway(config(url)) as gw, sdk(gw) as client:
            up = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
            batch = await client.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h")
            reference = answers(await output(client, (await finished(client, batch.id))[-1].output_file_id))
        proc = worker_process(llama_ckpt, url, log_path=tmp_path / "worker.log")
        try:
            async with running_gateway(config(url)) as gw, sdk(gw) as client, \
                    running_gateway(config(url)) as other, sdk(other) as other_client:
                interrupted = await client.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h")
                # Any gateway answers for a batch another created.
                assert (await other_client.batches.retrieve(interrupted.id)).id == interrupted.id
                await until(lambda: _done_at_least(client, interrupted.id, 1), timeout=240, interval=0.02)
                await gw.close()  # the gateway that drove it goes away mid-batch
                before = (await other_client.batches.retrieve(interrupted.id)).request_counts.completed
                await until(lambda: _done_at_least(other_client, interrupted.id, before + 1), timeout=120,
                            interval=0.02)  # the other gateway carries on
                proc.kill()  # SIGKILL, mid-answer
                proc.wait()
                mid = (await other_client.batches.retrieve(interrupted.id)).request_counts.completed
                assert mid < total, "the batch ended before the worker was killed"
        finally:
            kill_all({"worker": proc})
        await asyncio.to_thread(server.restart, 0.5)
        async with running_worker(llama_ckpt, url), running_gateway(config(url)) as fresh, sdk(fresh) as client:
            end = (await finished(client, interrupted.id))[-1]
            assert end.status == "completed" and end.request_counts.completed == total
            out = await output(client, end.output_file_id)
    ids = Counter(x["custom_id"] for x in out)
    assert set(ids) == {line["custom_id"] for line in lines} and set(ids.values()) == {1}
    assert answers(out) == reference


async def _done_at_least(client: openai.AsyncOpenAI, batch_id: str, count: int) -> bool:
    return (await client.batches.retrieve(batch_id)).request_counts.completed >= count


@pytest.mark.anyio
async def test_the_docs_example_runs_as_written(llama_ckpt: Path, redis_url: str) -> None:
    """docs/openai.md's Batch API example, with only the gateway's address changed."""
    # It prints the statuses it polled, then each answer after its custom_id (random text).
    printed = await run_docs_example("## Batch API", llama_ckpt, redis_url)
    assert "completed BatchRequestCounts(completed=3, failed=0, total=3)" in printed
    assert all(f"\nq{i} " in printed for i in range(3))


@pytest.mark.anyio
async def test_a_batch_past_its_window_ends_expired_with_what_finished(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    lines = [*chat_lines(model, 2, max_tokens=4), *chat_lines(model, 40, max_tokens=400)[2:]]
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        up = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await client.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h")
        await until(lambda: _done_at_least(client, batch.id, 2), timeout=60)
        # The window ends now: its end time in Redis moved to the past (as 24 h later would).
        r = aioredis.Redis.from_url(redis_url)
        try:
            key = f"{NAMES.prefix}:batch:{batch.id}"
            fixed = json.loads(await r.hget(key, "obj"))
            await r.hset(key, "obj", json.dumps({**fixed, "expires_at": int(time.time()) - 1}))
        finally:
            await r.aclose()
        end = (await finished(client, batch.id))[-1]
        outs = await output(client, end.output_file_id)
        errors = await output(client, end.error_file_id)
    assert end.status == "expired" and end.expired_at is not None
    assert {"req-0", "req-1"} <= {x["custom_id"] for x in outs}
    assert all(e["error"]["code"] == "batch_expired" for e in errors) and len(outs) + len(errors) == 40
    assert end.request_counts.completed == len(outs) and end.request_counts.failed == len(errors)


@pytest.mark.anyio
async def test_completions_batches_per_tenant(llama_ckpt: Path, redis_url: str) -> None:
    """A /v1/completions batch whose lines hold several prompts (several jobs each), run under a tenant
    with max_concurrent 4 (the runner keeps within half of it); another tenant's key sees
    neither its files nor its batches."""
    model = str(llama_ckpt)
    tenants = {"acme": TenantLimits(max_concurrent=4), "beta": TenantLimits()}
    cfg = config(redis_url, tenants=tenants, key_tenants={"ka": "acme", "kb": "beta"})
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": [f"Once upon a time {i}", f"The number {i} is"], "max_tokens": 6,
                       "temperature": 0, "ignore_eos": True}} for i in range(4)]
    async with running_worker(llama_ckpt, redis_url), running_gateway(cfg) as gw:
        acme = openai.AsyncOpenAI(base_url=gw.url + "v1", api_key="ka", max_retries=0, timeout=60)
        beta = openai.AsyncOpenAI(base_url=gw.url + "v1", api_key="kb", max_retries=0, timeout=60)
        async with acme, beta:
            up = await acme.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
            batch = await acme.batches.create(input_file_id=up.id, endpoint="/v1/completions",
                                              completion_window="24h")
            with pytest.raises(openai.NotFoundError):
                await beta.files.retrieve(up.id)
            with pytest.raises(openai.NotFoundError):
                await beta.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await beta.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h")
            assert [f async for f in beta.files.list()] == [] and [b async for b in beta.batches.list()] == []
            end = (await finished(acme, batch.id))[-1]
            assert end.status == "completed" and end.request_counts.completed == 4 and end.error_file_id is None
            out = await output(acme, end.output_file_id)
            for x, line in zip(out, lines):
                body = x["response"]["body"]
                assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1]
                # (asked by the unlimited tenant: acme's slots free only as its worker next reports)
                live = await beta.completions.create(**{k: v for k, v in line["body"].items() if k != "ignore_eos"},
                                                     extra_body={"ignore_eos": True})
                assert [c["text"] for c in body["choices"]] == [c.text for c in live.choices]
                assert body["usage"]["completion_tokens"] == 12


def test_the_batch_lane_is_read_after_every_other_lane() -> None:
    names = Names(lanes=(-10, -1))
    assert names.lane_for(BATCH_PRIORITY) == ("llm:requests:batch", BATCH_LANE_RANK)
    assert names.lane_for(BATCH_PRIORITY - 1) == ("llm:requests", DEFAULT_LANE_RANK)
    assert names.lane_for(-5) == ("llm:requests:prio-1", -1)
    registry = [(b"llm:requests:batch", BATCH_LANE_RANK), (b"llm:requests:batch:t:acme", BATCH_LANE_RANK),
                (b"llm:requests:prio-1", -1), (b"llm:requests", DEFAULT_LANE_RANK)]
    order = [(i.stream, i.tenant) for i in parse_registry(names, registry)]
    assert order == [("llm:requests:prio-1", ""), ("llm:requests", ""), ("llm:requests:batch", ""),
                     ("llm:requests:batch:t:acme", "acme")]
    # Its shared route: the tenant's queue inside the batch lane.
    assert lane_route(names, {"priority": BATCH_PRIORITY, "tenant": "acme"}).stream == "llm:requests:batch:t:acme"
