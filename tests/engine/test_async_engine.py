"""AsyncEngine: concurrent streams, early exit aborts, rejections raise before the first output."""

from __future__ import annotations

import asyncio

import pytest

from streamer import LLM, AsyncEngine, EngineConfig, QueueFullError, SamplingParams


@pytest.mark.anyio
async def test_concurrent_streams_match_offline(llama_ckpt):
    prompts = [f"request number {i}" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(str(llama_ckpt), dtype="float32", num_kv_blocks=64)
    offline = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    async with AsyncEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64)) as engine:
        async def run(i: int) -> tuple[list[int], int]:
            tokens, deltas = [], 0
            async for out in engine.generate(prompts[i], params, f"r{i}"):
                tokens += out.outputs[0].token_ids
                deltas += 1
            assert out.finished and out.outputs[0].finish_reason == "length"
            return tokens, deltas

        results = await asyncio.gather(*(run(i) for i in range(6)))
    assert [r[0] for r in results] == offline
    assert all(deltas == 12 for _, deltas in results)  # one delta per generated token


@pytest.mark.anyio
async def test_leaving_early_aborts_and_frees_blocks(llama_ckpt):
    async with AsyncEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64)) as engine:
        stream = engine.generate("stop me", SamplingParams(max_tokens=500, ignore_eos=True), "early")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            stats = engine.stats()
            if stats["num_requests_aborted"] == 1:
                break
        assert stats["num_requests_aborted"] == 1 and stats["kv_blocks_used"] == 0

        async def cancelled_consumer() -> None:
            async for _ in engine.generate("cancel me", SamplingParams(max_tokens=500, ignore_eos=True), "c"):
                pass

        task = asyncio.create_task(cancelled_consumer())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats()["num_requests_aborted"] == 2:
                break
        assert engine.stats()["num_requests_aborted"] == 2 and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.anyio
async def test_rejections_raise_before_any_output(llama_ckpt):
    config = EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64, max_waiting_requests=1,
                          max_num_seqs=1)
    async with AsyncEngine(config) as engine:
        with pytest.raises(ValueError, match="at most"):
            async for _ in engine.generate({"prompt_token_ids": [5] * 4000}, SamplingParams(), "long"):
                pass
        first = engine.generate("a", SamplingParams(max_tokens=1000, ignore_eos=True), "a")  # ~2 s of steps
        await first.__anext__()  # "a" runs; the single waiting slot is free again
        second = engine.generate("b", SamplingParams(max_tokens=5), "b")
        third = engine.generate("c", SamplingParams(max_tokens=5), "c")
        second_task = asyncio.create_task(second.__anext__())
        await asyncio.sleep(0.2)
        with pytest.raises(QueueFullError):
            await third.__anext__()
        await first.aclose()
        assert (await second_task).request_id == "b"
        await second.aclose()


class RecordingTokenizer:
    """The real tokenizer, noting the thread of every encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.threads = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        import threading

        self.threads.append(threading.current_thread().name)
        return self.tokenizer(*args, **kwargs)


@pytest.mark.anyio
async def test_prompts_are_tokenized_off_the_engine_thread_and_hopeless_ones_not_at_all(llama_ckpt):
    """A long prompt must delay only its own request: it is tokenized on the tokenizer thread, never on
    the engine's (which would stall every stream) or the event loop; a text longer than the model's
    length times the longest vocabulary entry is refused without being tokenized."""
    config = EngineConfig(model=str(llama_ckpt), dtype="float32", num_kv_blocks=64, max_model_len=256)
    async with AsyncEngine(config) as engine:
        recording = engine._prompts.tokenizer = RecordingTokenizer(engine._prompts.tokenizer)
        params = SamplingParams(temperature=0, max_tokens=4)
        outs = [out async for out in engine.generate("a prompt of some words", params, "text")]
        chat = await engine.render_chat([{"role": "user", "content": "hello"}])
        outs += [out async for out in engine.generate(chat, params, "chat")]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 8
        assert recording.threads and set(recording.threads) == {"streamer-tokenize_0"}
        recording.threads.clear()
        longest = engine._prompts.max_token_chars
        with pytest.raises(ValueError, match=f"prompt has {255 * longest + 1} characters"):
            async for _ in engine.generate("x" * (255 * longest + 1), params, "huge"):
                pass
        assert recording.threads == []  # refused before tokenizing
        with pytest.raises(ValueError, match="tokens but the model allows at most 255"):
            async for _ in engine.generate("ab " * 300, params, "long"):
                pass
        assert engine.stats()["num_requests"] == 0
