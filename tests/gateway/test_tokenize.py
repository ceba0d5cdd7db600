"""`/tokenize` and `/detokenize` (vLLM's shapes) through a real gateway and worker: jobs on the queue
answered by the worker's tokenizer, equal to the checkpoint's own tokenizer (transformers)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from redis_worker_helpers import running_worker
from test_gateway import config
from transformers import AutoTokenizer

from clients import AsyncClient
from workers.gateway.server import running_gateway

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the paged cache"}]


@pytest.mark.anyio
async def test_tokenize_and_detokenize_equal_the_checkpoints_tokenizer(llama_ckpt: Path, redis_url: str) -> None:
    hf = AutoTokenizer.from_pretrained(llama_ckpt)
    model = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        text = "the paged cache stores blocks"
        r = await http.post("/tokenize", json={"model": model, "prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        got = r.json()
        want = hf(text).input_ids  # a text gets the tokenizer's special tokens, as in vLLM
        assert got["tokens"] == want and got["count"] == len(want)
        assert got["token_strs"] == [hf.decode([t]) for t in want]
        assert got["max_model_len"] > 0
        bare = (await http.post("/tokenize", json={"model": model, "prompt": text,
                                                   "add_special_tokens": False})).json()
        assert bare["tokens"] == hf(text, add_special_tokens=False).input_ids and bare["token_strs"] is None
        chat = (await http.post("/tokenize", json={"model": model, "messages": CHAT})).json()
        rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert chat["tokens"] == hf(rendered, add_special_tokens=False).input_ids
        no_prompt = (await http.post("/tokenize", json={"model": model, "messages": CHAT,
                                                        "add_generation_prompt": False})).json()
        assert no_prompt["count"] < chat["count"]
        r = await http.post("/detokenize", json={"model": model, "tokens": want})
        assert r.status_code == 200 and r.json() == {"prompt": hf.decode(want)}


@pytest.mark.anyio
async def test_bad_tokenize_requests_get_openai_errors(llama_ckpt: Path, redis_url: str) -> None:
    model = str(llama_ckpt)
    vocab = AutoTokenizer.from_pretrained(llama_ckpt).vocab_size
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        cases = [("/tokenize", {"model": model, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
                 ("/tokenize", {"model": model, "prompt": "x", "messages": CHAT}, 400, "prompt"),
                 ("/tokenize", {"model": model, "prompt": "x", "add_generation_prompt": True}, 400,
                  "add_generation_prompt"),
                 ("/tokenize", {"model": model, "prompt": 5}, 400, "prompt"),
                 ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
                 ("/detokenize", {"model": model, "tokens": []}, 400, "tokens"),
                 ("/detokenize", {"model": model, "tokens": [1, -2]}, 400, None)]
        for path, body, status, param in cases:
            r = await http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        # Past the vocabulary: refused by the worker, which answers the next one as before.
        r = await http.post("/detokenize", json={"model": model, "tokens": [1, vocab + 5]})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request"), r.text
        assert "token ids must be in [0, " in r.json()["error"]["message"], r.text
        assert (await http.post("/detokenize", json={"model": model, "tokens": [1, 2]})).status_code == 200


@pytest.mark.anyio
async def test_a_raw_tokenize_job_on_the_queue_is_answered_with_a_result(llama_ckpt: Path, redis_url: str) -> None:
    hf = AutoTokenizer.from_pretrained(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        rid = "raw-tokenize"
        raw = ('{"v": 1, "id": "raw-tokenize", "task": "tokenize", "prompt": "hello there", '
               '"options": {"add_special_tokens": false}}')
        await client.redis.xadd(client.names.requests, {"json": raw})  # as redis-cli XADD would
        events = [e async for e in client.stream(rid, timeout=60)]
        assert [e["type"] for e in events] == ["done"]
        assert events[0]["result"]["tokens"] == hf("hello there", add_special_tokens=False).input_ids
