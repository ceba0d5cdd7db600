"""The checkpoint's generation_config.json sampling parameters apply to requests that leave them out
(as vLLM's server applies them), on the Redis path and the OpenAI API alike; a request's own values win."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from redis_worker_helpers import offline_completions, running_worker
from test_gateway import config

from clients import AsyncClient
from streamer import SamplingParams
from streamer.generation_defaults import generation_defaults
from workers.gateway.server import running_gateway


def with_defaults(src: Path, dst: Path, **defaults: object) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **defaults}))
    return dst


def test_only_sampling_keys_are_read_and_bad_values_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "max_length": 99}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -3}))
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}
    assert generation_defaults(tmp_path / "nowhere") == {}


@pytest.mark.anyio
async def test_a_request_without_a_temperature_gets_the_checkpoints(llama_ckpt: Path, redis_url: str,
                                                                    tmp_path: Path) -> None:
    """The checkpoint says greedy (temperature 0): a request that names no temperature is answered
    greedily on both paths; one that names its own temperature samples."""
    ckpt = with_defaults(llama_ckpt, tmp_path / "greedy-by-default", temperature=0.0)
    prompt = "The defaults of the checkpoint"
    (greedy, greedy_text), = offline_completions(llama_ckpt, [prompt], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))
    async with running_worker(ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            AsyncClient(redis_url) as client, \
            openai.AsyncOpenAI(base_url=gw.url + "v1", api_key="none", max_retries=0, timeout=60) as sdk:
        left_out = await client.generate(prompt, params={"max_tokens": 12, "ignore_eos": True}, timeout=60)
        own = await client.generate(prompt, params={"max_tokens": 12, "ignore_eos": True, "temperature": 1.5,
                                                    "seed": 3}, timeout=60)
        via_openai = await sdk.completions.create(model=str(ckpt), prompt=prompt, max_tokens=12,
                                                  extra_body={"ignore_eos": True})
    assert left_out.token_ids[0] == greedy
    assert via_openai.choices[0].text == greedy_text
    assert own.token_ids[0] != greedy
