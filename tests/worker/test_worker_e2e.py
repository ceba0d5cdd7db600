"""The Redis worker end to end: real redis-server, real engine, the Python client and redis-cli."""

import json
import shutil
import signal
import subprocess
import sys
import time

import anyio
import pytest
import redis
from redis_worker_helpers import (
    ENGINE,
    ROOT,
    check_complete,
    long_context_checkpoint,
    offline_completions,
    offline_tokens,
    read_events,
    running_worker,
    tokens_of,
    wait_for,
)

from clients.errors import RequestFailed
from clients.protocol import Names, decode_message
from clients.redis_client import AsyncClient, Client
from streamer import LLM, SamplingParams

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.anyio
async def test_20_concurrent_jobs_match_offline_engine(llama_ckpt, redis_url):
    prompts = [f"Request number {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(20)]
    expected = offline_completions(llama_ckpt, prompts, SamplingParams(**GREEDY))
    results = {}
    async with running_worker(llama_ckpt, redis_url) as worker, \
            AsyncClient(redis_url) as json_client, AsyncClient(redis_url, encoding="msgpack") as mp_client:

        async def one(i):
            client = json_client if i % 2 else mp_client
            results[i] = await client.generate(prompts[i], params=GREEDY, timeout=30)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
        round_trips = worker.writer.round_trips
    for i, (exp_tokens, exp_text) in enumerate(expected):
        assert results[i].token_ids[0] == exp_tokens and results[i].text == exp_text, f"prompt {i}"
        assert results[i].finish_reason == "length"
        assert results[i].usage["completion_tokens"] == 8
        events = read_events(redis_url, results[i].id)
        check_complete(events)
        assert tokens_of(events) == exp_tokens
    # Writes of one step are pipelined: far fewer round trips than the 180 events written.
    assert round_trips < 120, round_trips


@pytest.mark.anyio
async def test_token_ids_messages_and_n_samples(llama_ckpt, redis_url):
    params = {"max_tokens": 5, "temperature": 0.0, "n": 2, "ignore_eos": True}
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        by_ids = await client.generate(prompt_token_ids=[5, 6, 7, 8], params=params, timeout=30)
        chat = await client.generate(messages=[{"role": "user", "content": "Hello there"}],
                                     params=GREEDY, timeout=30)
    expected = offline_tokens(llama_ckpt, [[5, 6, 7, 8]], SamplingParams(**params))[0]
    assert by_ids.token_ids == {0: expected, 1: expected}
    assert by_ids.finish_reasons == ["length", "length"] and by_ids.usage["completion_tokens"] == 10
    assert len(chat.token_ids[0]) == 8 and chat.usage["prompt_tokens"] > 4
    events = read_events(redis_url, by_ids.id)
    assert all("logprobs" not in e for e in events)


@pytest.mark.anyio
async def test_logprobs_in_token_events(llama_ckpt, redis_url):
    params = {**GREEDY, "logprobs": 2}
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url, encoding="msgpack") as client:
        result = await client.generate(prompt_token_ids=[5, 6, 7], params=params, timeout=30)
    expected = LLM(**{"model": str(llama_ckpt), **ENGINE}).generate([[5, 6, 7]], SamplingParams(**params))
    want = [sorted([t, pytest.approx(lp, abs=1e-4)] for t, lp in step.items())
            for step in expected[0].outputs[0].logprobs]
    got = [sorted(pair for pair in step) for e in read_events(redis_url, result.id) if e["type"] == "token"
           for step in e["logprobs"]]
    assert got == want


@pytest.mark.anyio
async def test_beam_search(llama_ckpt, redis_url):
    params = {"max_tokens": 5, "use_beam_search": True, "beam_width": 3, "ignore_eos": True}
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        result = await client.generate(prompt_token_ids=[5, 6, 7], params=params, timeout=30)
    llm = LLM(**{"model": str(llama_ckpt), **ENGINE})
    expected = llm.generate([[5, 6, 7]], SamplingParams(**params))[0].outputs
    assert result.token_ids == {o.index: list(o.token_ids) for o in expected}
    assert len(result.finish_reasons) == len(expected) == 3


@pytest.mark.anyio
async def test_redis_cli_json_path_and_pubsub(llama_ckpt, redis_url, redis_server):
    cli = shutil.which("redis-cli")
    assert cli, "redis-cli is installed with redis-server"
    subscriber = redis.Redis.from_url(redis_url).pubsub()
    subscriber.subscribe(Names().tokens("a1"))
    async with running_worker(llama_ckpt, redis_url):
        # Exactly the command from the protocol documentation, as a subprocess.
        subprocess.run([cli, "-p", str(redis_server.port), "XADD", "llm:requests", "*", "json",
                        '{"v":1,"id":"a1","prompt":"Hello","params":{"max_tokens":16}}'],
                       check=True, capture_output=True, timeout=10)
        await wait_for(lambda: read_events(redis_url, "a1")[-1:] and
                       read_events(redis_url, "a1")[-1]["type"] == "done", timeout=30)
    events = read_events(redis_url, "a1")
    assert check_complete(events)["finish_reason"] in ("length", "stop")
    assert all(e["v"] == 1 and e["id"] == "a1" for e in events)
    live = []
    while (message := subscriber.get_message(timeout=1)) is not None:
        if message["type"] == "message":
            live.append(decode_message(message["data"]))
    subscriber.close()
    assert live == events  # the channel carried the same events, in order, once each
    # The job left the requests stream once answered.
    assert redis.Redis.from_url(redis_url).xlen("llm:requests") == 0


@pytest.fixture(scope="module")
def long_context_ckpt(tmp_path_factory):
    return long_context_checkpoint(tmp_path_factory.mktemp("llama16k"))


@pytest.mark.anyio
async def test_cancel_frees_blocks(long_context_ckpt, redis_url):
    r = redis.Redis.from_url(redis_url)
    async with running_worker(long_context_ckpt, redis_url, engine={"num_kv_blocks": 1100}) as worker, \
            AsyncClient(redis_url) as client:
        key = Names().worker(worker.cfg.consumer)
        rid = await client.submit("a long answer please", params={"max_tokens": 16000, "ignore_eos": True})
        stream = client.stream(rid, timeout=30)
        first = await anext(stream)
        assert first["type"] == "token"
        await wait_for(lambda: int(r.hget(key, "kv_blocks_used") or 0) > 0, timeout=10)
        await client.cancel(rid)
        rest = [e async for e in stream]
        assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "abort"
        assert len(tokens_of([first, *rest])) < 16000
        await wait_for(lambda: int(r.hget(key, "kv_blocks_used")) == 0 and int(r.hget(key, "running")) == 0,
                       timeout=10)
        assert r.hget(key, "model") == str(long_context_ckpt).encode()
        # A job cancelled before any worker read it (its marker set first, as any client may) is
        # answered with abort, not run. (client.cancel only cancels ids that exist: test_bounded_redis.)
        rid2 = "cancelled-early"
        r.set(Names().cancelled(rid2), 1, ex=60)
        await client.submit("x", id=rid2, params=GREEDY)
        events = [e async for e in client.stream(rid2, timeout=30)]
        assert [e["type"] for e in events] == ["done"] and events[0]["finish_reason"] == "abort"
    r.close()


@pytest.mark.anyio
async def test_deadline_and_resumed_stream(llama_ckpt, redis_url):
    async with running_worker(llama_ckpt, redis_url), AsyncClient(redis_url) as client:
        past = int(time.time() * 1000) - 1000
        rid = await client.submit("late", params=GREEDY, deadline=past)
        with pytest.raises(RequestFailed) as info:
            await client.generate("late", params=GREEDY, deadline=past, timeout=30)
        assert info.value.code == "expired"
        ok = await client.generate("on time", params=GREEDY, deadline=int(time.time() * 1000) + 60_000,
                                   timeout=30)
        assert len(ok.token_ids[0]) == 8
        # stream() from a given seq returns exactly the rest (what a reconnecting client does).
        tail = [e async for e in client.stream(ok.id, after_seq=3, timeout=5)]
        assert [e["seq"] for e in tail] == list(range(4, ok.events))
        assert [e["type"] async for e in client.stream(rid, timeout=5)] == ["error"]


def test_sync_client_and_generate_cli(llama_ckpt, redis_url):
    async def serve_until(done):
        async with running_worker(llama_ckpt, redis_url):
            await done.wait()

    import threading

    from anyio.from_thread import start_blocking_portal

    with start_blocking_portal("asyncio") as portal:
        done = portal.call(anyio.Event)
        future = portal.start_task_soon(serve_until, done)
        try:
            with Client(redis_url) as client:
                result = client.generate("Hello", params=GREEDY, timeout=30)
                assert len(result.token_ids[0]) == 8
                events = list(client.stream(result.id, timeout=5))
                assert "".join(e["text"] for e in events) == result.text
            cli = subprocess.run([sys.executable, "-m", "workers.cli", "generate", "Hello", "--redis", redis_url,
                                  "--max-tokens", "8", "--params", '{"ignore_eos": true}'],
                                 cwd=ROOT, capture_output=True, timeout=60)
            assert cli.returncode == 0, cli.stderr.decode()
            # A pipe gets the answer as a whole line: ended by a newline.
            assert cli.stdout.decode() == result.text + ("" if result.text.endswith("\n") else "\n")
            assert "8 generated tokens" in cli.stderr.decode()
        finally:
            portal.call(done.set)
            future.result(timeout=30)
    assert not [t for t in threading.enumerate() if t.name == "streamer-engine"]


def test_protocol_doc_examples_are_json():
    """The request line in the docs is what the redis-cli test sends."""
    doc = (ROOT / "docs" / "protocol.md").read_text()
    line = """XADD llm:requests '*' json '{"v":1,"id":"a1","prompt":"Hello","params":{"max_tokens":16}}'"""
    assert line in doc
    assert json.loads(line.split("json ", 1)[1].strip("'"))["v"] == 1


@pytest.mark.anyio
async def test_reads_only_what_the_engine_can_admit(llama_ckpt, redis_url):
    """With room for 2 sequences the worker takes 2 jobs at a time (plus finished ones awaiting their
    ack); the rest of the backlog stays undelivered in Redis, free for other workers."""
    r = redis.Redis.from_url(redis_url)
    names = Names()
    held = []
    async with running_worker(llama_ckpt, redis_url, engine={"max_num_seqs": 2}), \
            AsyncClient(redis_url) as client:
        ids = [await client.submit(f"backlog {i}", params={**GREEDY, "max_tokens": 40}) for i in range(8)]

        async def watch():
            while True:
                group = r.xinfo_groups(names.requests)[0]
                # XINFO's "lag" is nil once acked entries were deleted from the stream, so count the
                # undelivered entries directly: those after the group's last delivered id.
                after = "(" + group["last-delivered-id"].decode()
                held.append((group["pending"], len(r.xrange(names.requests, after, "+"))))
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            for rid in ids:
                assert [e async for e in client.stream(rid, timeout=30)][-1]["type"] == "done"
            tg.cancel_scope.cancel()
    # 2 running + 2 finished awaiting their ack (+2 when the engine's published capacity lags one
    # step behind the outputs it delivers): never the whole backlog.
    assert max(pending for pending, _ in held) <= 6, held
    assert max(lag for _, lag in held) >= 5, held
    assert r.xlen(names.requests) == 0
    r.close()


@pytest.mark.anyio
async def test_generate_cli_ctrl_c_cancels_the_request(long_context_ckpt, redis_url):
    r = redis.Redis.from_url(redis_url)
    async with running_worker(long_context_ckpt, redis_url, engine={"num_kv_blocks": 1100}):
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "generate", "hi", "--redis", redis_url,
                                 "--max-tokens", "16000", "--params", '{"ignore_eos": true}'],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            await wait_for(lambda: r.keys("llm:events:*"), timeout=60)
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 130
        rid = r.keys("llm:events:*")[0].decode().split(":", 2)[2]
        await wait_for(lambda: read_events(redis_url, rid)[-1]["type"] == "done", timeout=10)
    done = read_events(redis_url, rid)[-1]
    assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] < 16000
    r.close()
