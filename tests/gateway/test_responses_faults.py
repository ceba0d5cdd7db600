"""A background response survives everything (docs/openai.md#responses-api): its worker SIGKILLed
mid-answer, the gateway that created it stopped, Redis restarted (AOF); its event stream, resumed with
`starting_after` through other gateways, is every event once, numbered without a gap, and the same as
an uninterrupted run's (greedy)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from redis_worker_helpers import kill_all, running_worker, worker_process
from test_batches import until
from test_gateway import config
from test_openai_api import sdk
from test_responses import GREEDY, numbered

from workers.gateway.server import running_gateway
from workers.redis_server import RedisServer

TOKENS = 400
REQUEST = {"input": "Tell me a long story about foxes.", "max_output_tokens": TOKENS, "background": True,
           "stream": True, **GREEDY}


def shape(events: list[Any]) -> list[tuple[Any, ...]]:
    """What two runs of the same greedy response share (their ids differ)."""
    return [(e.sequence_number, e.type, getattr(e, "delta", None)) for e in events]


async def read(stream: Any, until_seq: int | None = None) -> list[Any]:
    """The stream's events, up to `until_seq` (then the client goes away), or to its end."""
    out = []
    async with stream:
        async for event in stream:
            out.append(event)
            if until_seq is not None and event.sequence_number >= until_seq:
                break
    return out


@pytest.mark.anyio
async def test_a_background_response_resumes_after_worker_gateway_and_redis_restarts(llama_ckpt: Path,
                                                                                     tmp_path: Path) -> None:
    model = str(llama_ckpt)
    with RedisServer(appendonly=True) as server:
        url = server.url
        async with running_worker(llama_ckpt, url), running_gateway(config(url)) as gw, sdk(gw) as client:
            reference = await read(await client.responses.create(model=model, **REQUEST))
        numbered(reference)
        proc = worker_process(llama_ckpt, url, "--claim-idle", "5", log_path=tmp_path / "worker.log")
        try:
            async with running_gateway(config(url)) as other, sdk(other) as other_client:
                await until(lambda: _worker_up(other_client), timeout=120)  # its start is not the answer's time
                async with running_gateway(config(url)) as gw, sdk(gw) as client:
                    first = await read(await client.responses.create(model=model, **REQUEST), until_seq=8)
                    proc.kill()  # SIGKILL, mid-answer
                    proc.wait()
                # The gateway that created it is gone; another one answers for it.
                response_id = first[0].response.id
                mid = await other_client.responses.retrieve(response_id)
                assert mid.status == "in_progress", "the response ended before its worker was killed"
                await asyncio.to_thread(server.restart, 0.5)
                async with running_worker(llama_ckpt, url), running_gateway(config(url)) as fresh, \
                        sdk(fresh) as fresh_client:
                    second = await read(await fresh_client.responses.retrieve(
                        response_id, stream=True, starting_after=first[-1].sequence_number), until_seq=40)
                    # The rest through the gateway that lived through the Redis restart.
                    third = await read(await _retrieve_stream(other_client, response_id, second[-1].sequence_number))
                    end = await fresh_client.responses.retrieve(response_id)
        finally:
            kill_all({"worker": proc})
    events = [*first, *second, *third]
    numbered(events)  # no gap, no duplicate
    assert shape(events) == shape(reference)
    assert end.status == "incomplete" and end.usage is not None and end.usage.output_tokens == TOKENS
    assert end.output_text == reference[-1].response.output_text


async def _worker_up(client: openai.AsyncOpenAI) -> bool:
    return bool((await client.models.list()).data)


async def _retrieve_stream(client: openai.AsyncOpenAI, response_id: str, after: int) -> Any:
    """The resumed stream; the gateway may still be reconnecting to the restarted Redis (a 503 then)."""
    result: list[Any] = []

    async def opened() -> bool:
        try:
            result.append(await client.responses.retrieve(response_id, stream=True, starting_after=after))
        except openai.InternalServerError:
            return False
        return True

    await until(opened, timeout=30, interval=0.2)
    return result[0]
