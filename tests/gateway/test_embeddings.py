"""`/v1/embeddings` through a real gateway and worker (tiny Llama, float32), driven by the official
`openai` SDK as a user calls it: vectors equal to transformers' final hidden states pooled the same way,
float and base64, usage; bad requests answered with OpenAI errors and nothing else disturbed; batch
lines; a raw embed job on the queue; docs/openai.md's example as written."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from docs_examples import run_docs_example
from redis_worker_helpers import running_worker
from test_batches import finished, jsonl, output, sdk
from test_gateway import config
from test_pooling import hf_pooled
from transformers import AutoTokenizer

from clients import AsyncClient
from workers.gateway.server import running_gateway

TEXTS = ["The quick brown fox", "paged KV cache blocks", "Redis streams carry jobs from clients"]
TOLERANCE = 1e-5


def close(got: list[float], expected: torch.Tensor) -> bool:
    return (torch.tensor(got) - expected).abs().max().item() < TOLERANCE


def vectors(body: dict[str, Any]) -> list[list[float]]:
    """An embeddings answer's vectors, float or base64 (OpenAI's: little-endian float32)."""
    out = []
    for item in body["data"]:
        vector = item["embedding"]
        if isinstance(vector, str):
            packed = base64.b64decode(vector)
            vector = list(struct.unpack(f"<{len(packed) // 4}f", packed))
        out.append(vector)
    return out


@pytest.mark.anyio
async def test_the_sdk_gets_transformers_pooled_hidden_states(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    ids = [AutoTokenizer.from_pretrained(llama_ckpt)(t).input_ids for t in TEXTS]
    last, mean = hf_pooled(llama_ckpt, ids, "last"), hf_pooled(llama_ckpt, ids, "mean")
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        floats = await client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        # The SDK's default asks for base64 and decodes it itself.
        decoded, tokens, one = await asyncio.gather(
            client.embeddings.create(model=model, input=TEXTS),
            client.embeddings.create(model=model, input=ids, extra_body={"pooling": "mean"}),
            client.embeddings.create(model=model, input=ids[1], encoding_format="float"))
        raw = (await client.with_raw_response.embeddings.create(model=model, input=TEXTS[0],
                                                                 encoding_format="base64")).http_response.json()
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list" and floats.model == model
    assert all(close(d.embedding, want) for d, want in zip(floats.data, last, strict=True))
    # (Not bit for bit: batched with other requests, the GEMMs' blocking differs.)
    assert all(close(d.embedding, want) for d, want in zip(decoded.data, last, strict=True))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert all(close(d.embedding, want) for d, want in zip(tokens.data, mean, strict=True))
    assert len(one.data) == 1 and close(one.data[0].embedding, last[1])
    assert isinstance(raw["data"][0]["embedding"], str) and close(vectors(raw)[0], last[0])
    assert abs(sum(x * x for x in floats.data[0].embedding) - 1.0) < 1e-5  # normalised by default


@pytest.mark.anyio
async def test_bad_embedding_requests_get_openai_errors(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    cases: list[tuple[dict[str, Any], int, str | None, str]] = [
        ({"input": ""}, 400, "input", "is empty"),
        ({"input": []}, 400, "input", "not empty"),
        ({"input": ["a", ""]}, 400, "input", "`input[1]` is empty"),
        ({"input": [[]]}, 400, "input", "`input[0]` is empty"),
        ({"input": 5}, 400, "input", "must be a string"),
        ({"input": ["a", [1, 2]]}, 400, "input", "mixes strings and token ids"),
        ({"input": [[1, "a"]]}, 400, "input", "neither a string nor"),
        ({"input": [True, 2]}, 400, "input", "must be a string"),
        ({"input": [[1, -2]]}, 400, "input", "neither a string nor"),
        ({}, 400, "input", "provide an `input`"),
        ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "float"),
        ({"input": "a", "dimensions": 0}, 400, "dimensions", "positive integer"),
        ({"input": "a", "pooling": "cls"}, 400, "pooling", "last"),
        ({"input": "a", "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
        ({"input": ["a"] * 2049}, 400, "input", "at most 2048"),
        ({"input": "a", "model": "no-such-model"}, 404, "model", "does not exist"),
    ]
    async with running_worker(llama_ckpt, redis_url, engine={"max_model_len": 64}), \
            running_gateway(config(redis_url)) as gw, httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        for body, status, param, said in cases:
            r = await http.post("/v1/embeddings", json={"model": model, **body})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and said in error["message"], (body, error)
        # Refused by the worker, as the model is: answered as 400s, and the worker serves on.
        for body, said in (({"input": "a", "dimensions": 8}, "not a matryoshka model"),
                           ({"input": [[7] * 65]}, "at most 64"),
                           ({"input": "the paged cache " * 40}, "64"),  # in tokens, or already in characters
                           ({"input": [[100000]]}, "outside the vocabulary")):
            r = await http.post("/v1/embeddings", json={"model": model, **body})
            assert r.status_code == 400 and said in r.json()["error"]["message"], (body, r.text)
        full = await http.post("/v1/embeddings", json={"model": model, "input": [[7] * 64]})  # fills the model
        chat = await http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]})
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == 64
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4


@pytest.mark.anyio
async def test_embeddings_batch_lines(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    bodies = [{"model": model, "input": TEXTS[:2]}, {"model": model, "input": TEXTS[2], "encoding_format": "base64"},
              {"model": model, "input": ""}]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b}
             for i, b in enumerate(bodies[:2])]
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, sdk(gw) as client:
        refused = await client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(lines + [
            {"custom_id": "e2", "method": "POST", "url": "/v1/embeddings", "body": bodies[2]}]))), purpose="batch")
        bad = await client.batches.create(input_file_id=refused.id, endpoint="/v1/embeddings",
                                          completion_window="24h")
        up = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = await client.batches.create(input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h")
        end = (await finished(client, batch.id))[-1]
        outs = {x["custom_id"]: x for x in await output(client, end.output_file_id)}
        live = [(await client.with_raw_response.embeddings.create(**b)).http_response.json() for b in bodies[:2]]
    assert bad.status == "failed" and bad.errors is not None
    assert [e.line for e in bad.errors.data] == [3] and "is empty" in (bad.errors.data[0].message or "")
    assert end.status == "completed" and end.request_counts is not None and end.request_counts.completed == 2
    for i, want in enumerate(live):
        response = outs[f"e{i}"]["response"]
        assert response["status_code"] == 200
        got = vectors(response["body"])
        assert len(got) == len(want["data"]) and all(map(close, got, map(torch.tensor, vectors(want))))
        assert response["body"]["usage"] == want["usage"]


@pytest.mark.anyio
async def test_a_raw_embed_job_on_the_queue_is_answered_with_a_result(llama_ckpt: Path, redis_url: str) -> None:
    ids = [5, 9, 30, 31, 32]
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        raw = json.dumps({"v": 1, "id": "raw-embed", "task": "embed", "prompt_token_ids": ids,
                          "options": {"pooling": "mean", "normalize": False}})
        await client.redis.xadd(client.names.requests, {"json": raw})  # as redis-cli XADD would
        events = [e async for e in client.stream("raw-embed", timeout=60)]
    assert [e["type"] for e in events] == ["done"] and events[0]["usage"]["prompt_tokens"] == len(ids)
    assert events[0]["result"]["prompt_tokens"] == len(ids)
    assert close(events[0]["result"]["embedding"], hf_pooled(llama_ckpt, [ids], "mean", normalize=False)[0])


@pytest.mark.anyio
async def test_the_docs_example_runs_as_written(llama_ckpt: Path, redis_url: str) -> None:
    """docs/openai.md's embeddings example, with only the gateway's address changed."""
    printed = (await run_docs_example("## Embeddings", llama_ckpt, redis_url)).splitlines()
    assert printed[0] == "2 vectors of 64 floats" and printed[1].startswith("prompt tokens: ")
    assert -1.0 <= float(printed[2].removeprefix("similarity: ")) <= 1.0  # normalised: a cosine
    assert printed[3] == "dimensions refused: 400"  # the tiny model is no matryoshka model
