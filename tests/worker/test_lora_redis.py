"""Multi-LoRA through Redis: the adapter registry (`streamer lora add|list|remove`) read by workers
for each job, kept across a worker restart; an unknown adapter answered with `invalid_request` and
nothing else disturbed; loaded adapters in the heartbeat; routing prefers a worker that has the job's
adapter; OpenAI model names `BASE:ADAPTER` and `ADAPTER`. A real redis-server throughout."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import redis
from lora_adapters import build_adapter, peft_greedy
from redis_worker_helpers import NAMES, running_worker

from clients import AsyncClient
from clients.errors import RequestFailed
from clients.routing import WorkerView, choose
from workers.cli.main import main
from workers.gateway.openai.lora_models import split_model

PROMPT = (10, 20, 30, 40, 50, 60, 70)
PARAMS = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("redis-adapters")
    return {"a1": build_adapter(llama_ckpt, root / "a1", seed=21, rank=8),
            "a2": build_adapter(llama_ckpt, root / "a2", seed=22, rank=4, targets=("q_proj", "v_proj", "down_proj"))}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


async def _tokens(client: AsyncClient, lora: str | None) -> list[int]:
    gen = await client.generate(prompt_token_ids=list(PROMPT), params=PARAMS, lora=lora, timeout=120)
    return gen.token_ids[0]


@pytest.mark.anyio
async def test_registry_restart_unknown_and_heartbeat(llama_ckpt: Path, adapters: dict[str, Path], redis_url: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, path in adapters.items():
        assert f"added {name} -> {path.resolve()}" in _cli(capsys, "lora", "add", name, str(path), "--redis", redis_url)
    listed = _cli(capsys, "lora", "list", "--redis", redis_url).splitlines()
    assert listed == [f"a1\t{adapters['a1'].resolve()}", f"a2\t{adapters['a2'].resolve()}"]
    expected = {name: peft_greedy(llama_ckpt, path, (PROMPT,), PARAMS["max_tokens"])[0]
                for name, path in adapters.items()}
    expected[None] = peft_greedy(llama_ckpt, None, (PROMPT,), PARAMS["max_tokens"])[0]
    assert len({tuple(t) for t in expected.values()}) == 3  # each adapter changes the answer

    client = AsyncClient(redis_url)
    try:
        async with running_worker(llama_ckpt, redis_url, engine={"max_loras": 2}) as worker:
            results: dict[str | None, list[int]] = {}
            failure: list[RequestFailed] = []

            async def one(lora: str | None) -> None:
                results[lora] = await _tokens(client, lora)

            async def unknown() -> None:
                with pytest.raises(RequestFailed) as info:
                    await _tokens(client, "nope")
                failure.append(info.value)

            async with anyio.create_task_group() as tg:  # base, two adapters and an unknown one at once
                for lora in (None, "a1", "a2"):
                    tg.start_soon(one, lora)
                tg.start_soon(unknown)
            assert results == expected
            assert failure[0].code == "invalid_request" and "unknown LoRA adapter 'nope'" in failure[0].message
            assert "streamer lora add" in failure[0].message
            # The heartbeat says which adapters are loaded (routers read it).
            r = redis.Redis.from_url(redis_url)
            with anyio.fail_after(5):
                while set((r.hget(NAMES.worker(worker.cfg.consumer), "loras") or b"").decode().split(",")) \
                        != {"a1", "a2"}:
                    await anyio.sleep(0.05)
            r.close()
        # A new worker (nothing loaded, nothing in memory) finds the same adapters in Redis.
        async with running_worker(llama_ckpt, redis_url, engine={"max_loras": 1}):
            assert await _tokens(client, "a2") == expected["a2"]
            assert await _tokens(client, "a1") == expected["a1"]  # evicts a2 (one slot)
            assert "removed a1" in _cli(capsys, "lora", "remove", "a1", "--redis", redis_url)
            with pytest.raises(RequestFailed, match="unknown LoRA adapter 'a1'"):
                await _tokens(client, "a1")
            assert await _tokens(client, None) == expected[None]
    finally:
        await client.aclose()


def test_cli_refuses_bad_names_and_folders(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lora", "add", "bad:name", str(tmp_path), "--redis", redis_url]) != 0
    assert "use 1 to 64 letters" in capsys.readouterr().err
    assert main(["lora", "add", "empty", str(tmp_path), "--redis", redis_url]) != 0
    assert "no adapter_config.json" in capsys.readouterr().err
    assert main(["lora", "remove", "ghost", "--redis", redis_url]) != 0
    assert "no LoRA adapter named 'ghost'" in capsys.readouterr().err
    assert redis.Redis.from_url(redis_url).hlen(NAMES.loras) == 0


def test_routing_prefers_a_worker_with_the_adapter() -> None:
    idle, loaded = WorkerView("w1", 0.1), WorkerView("w2", 0.5, has_adapter=True)
    # No prefix held anywhere: the worker with the adapter, though busier.
    assert choose("cache_load", [idle, loaded]) == choose("cache_load", [loaded, idle])
    assert choose("cache_load", [idle, loaded]).worker == "w2"
    assert choose("cache_load", [idle, loaded]).outcome == "adapter"
    # A full worker is not chosen for its adapter.
    assert choose("cache_load", [idle, WorkerView("w2", 1.6, has_adapter=True)]).outcome == "miss"
    # Both hold the prefix: the adapter wins over a longer discounted match ...
    a, b = WorkerView("w1", 0.0, matched=500), WorkerView("w2", 0.4, matched=200, has_adapter=True)
    assert choose("cache_load", [a, b]).worker == "w2"
    # ... and without an adapter term in play (base-model jobs) the match decides, as before.
    assert choose("cache_load", [WorkerView("w1", 0.0, matched=500), WorkerView("w2", 0.4, matched=200)]).worker == "w1"


def test_openai_model_names() -> None:
    bases = {"tiny", "org/model:v2"}
    assert split_model("tiny", bases) == ("tiny", None)
    assert split_model("tiny:a1", bases) == ("tiny", "a1")
    assert split_model("org/model:v2", bases) == ("org/model:v2", None)
    assert split_model("org/model:v2:a1", bases) == ("org/model:v2", "a1")
    assert split_model("a1", bases) == ("a1", "a1")  # an adapter named alone (looked up in the registry)
    assert split_model("other:a1", bases) == ("other:a1", None)  # not a served base: an unknown model


@pytest.mark.anyio
async def test_openai_api_serves_adapters(llama_ckpt: Path, adapters: dict[str, Path], redis_url: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import openai
    from test_gateway import config

    from streamer import LLM, SamplingParams
    from streamer.lora import LoRARequest
    from workers.gateway.server import running_gateway

    _cli(capsys, "lora", "add", "a1", str(adapters["a1"]), "--redis", redis_url)
    prompt = "The quick brown fox"
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=128)
    want = llm.generate([prompt, prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                        lora_request=[LoRARequest("a1", str(adapters["a1"])), None])
    want_a1, want_base = (o.outputs[0].text for o in want)
    assert want_a1 != want_base
    base = str(llama_ckpt)
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            openai.AsyncOpenAI(base_url=gw.url + "v1", api_key="none", max_retries=0, timeout=60) as client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {base, "a1"}
        assert models["a1"].root == str(adapters["a1"].resolve()) and models["a1"].parent == base
        for model, text in ((f"{base}:a1", want_a1), ("a1", want_a1), (base, want_base)):
            out = await client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                                  extra_body={"ignore_eos": True})
            assert out.choices[0].text == text and out.model == model, model
        with pytest.raises(openai.NotFoundError, match="no LoRA adapter `nope` is registered"):
            await client.completions.create(model=f"{base}:nope", prompt=prompt, max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
            await client.completions.create(model="nope", prompt=prompt, max_tokens=2)
