"""The worker's engine seam (workers/worker/engine.py) played by the test: what each prompt's request
yields is scripted, no model runs. With a real redis-server and a real `Worker` around it, a job's path
through the worker (its checks, admission, the outputs relayed as events, the engine's refusals and
failures) is tested in milliseconds, at edges a model cannot be made to hit on cue (a full queue, an
engine that dies, a stream that ends without a finished output)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from streamer import RequestOutput, SamplingParams
from streamer.outputs import CompletionOutput
from workers.worker.config import WorkerConfig
from workers.worker.redis_worker import Worker

PROMPT_IDS = [5, 6, 7]  # the prompt's token ids in every scripted output

# One step of a request's script: an output to yield, an exception to raise instead, or a pause (seconds).
Step = RequestOutput | BaseException | float


def output(*samples: CompletionOutput, finished: bool = False, cached: int = 0, error: str | None = None,
           error_code: str | None = None, request_id: str = "", embedding: list[float] | None = None) -> RequestOutput:
    return RequestOutput(request_id, list(PROMPT_IDS), list(samples), finished, num_cached_tokens=cached,
                         error=error, error_code=error_code, embedding=embedding)


def sample(index: int, text: str, token_ids: list[int], finish_reason: str | None = None,
           logprobs: list[dict[int, float]] | None = None) -> CompletionOutput:
    return CompletionOutput(index, text, token_ids, finish_reason, logprobs=logprobs)


def answer(text: str = "ab", token_ids: tuple[int, ...] = (1, 2), cached: int = 0) -> list[Step]:
    """A request that streams one token per step and finishes with "length"."""
    steps: list[Step] = [output(sample(0, text[i], [t])) for i, t in enumerate(token_ids[:-1])]
    return [*steps, output(sample(0, text[len(token_ids) - 1:], [token_ids[-1]], "length"), finished=True,
                           cached=cached)]


@dataclass
class Call:
    """One `generate` call as the worker made it."""

    prompt: Any
    params: SamplingParams
    request_id: str
    priority: int
    resume_token_ids: list[list[int]] | None
    session: str | None
    lora_request: Any
    at: float = field(default_factory=time.monotonic)  # when it was made


@dataclass
class ScriptedEngine:
    """`scripts[prompt]`: the steps of each `generate` call for that prompt, one list per call (the last
    list is reused by later calls). A prompt given as token ids (or rendered from messages by `render`,
    a TokenizedPrompt) is looked up as `ids:1,2,3`."""

    scripts: dict[str, list[list[Step]]] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)  # sampling_defaults()
    template: Any = None  # chat_template()
    render: Callable[[list[dict[str, Any]]], Any] | None = None  # render_chat; None: no chat template
    texts: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = field(default_factory=dict)  # output_text
    rendered: list[tuple[Any, Any]] = field(default_factory=list)  # (messages, tools) of each render_chat
    calls: list[Call] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    aborted_at: dict[str, float] = field(default_factory=dict)  # wall-clock time of each abort
    closed: list[str] = field(default_factory=list)  # requests whose output stream the worker closed
    _aborts: dict[str, anyio.Event] = field(default_factory=dict)

    def generate(self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0,
                 resume_token_ids: list[list[int]] | None = None, session: str | None = None,
                 lora_request: Any = None) -> AsyncGenerator[RequestOutput, None]:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else getattr(prompt, "token_ids", None)
        key = prompt if isinstance(prompt, str) else "ids:" + ",".join(map(str, ids))
        runs = self.scripts[key]
        n = sum(1 for c in self.calls if c.request_id == request_id)
        self.calls.append(Call(prompt, params, request_id, priority, resume_token_ids, session, lora_request))
        return self._run(request_id, runs[min(n, len(runs) - 1)])

    async def _run(self, request_id: str, steps: list[Step]) -> AsyncGenerator[RequestOutput, None]:
        aborted = self._aborts[request_id] = anyio.Event()
        try:
            for step in steps:
                if isinstance(step, BaseException):
                    raise step
                if isinstance(step, float):  # a pause that an abort ends, as the engine ends the request
                    with anyio.move_on_after(step):
                        await aborted.wait()
                    if aborted.is_set():
                        yield output(sample(0, "", [], "abort"), finished=True, request_id=request_id)
                        return
                    continue
                yield step
        finally:
            self.closed.append(request_id)

    async def embed(self, prompt: Any, params: Any, request_id: str, priority: int = 0,
                    session: str | None = None) -> RequestOutput:
        """The script's first output (an embed job has one); an abort during a pause returns one without
        an embedding, as the engine does."""
        stream = self.generate(prompt, params, request_id, priority, session=session)
        try:
            return await anext(stream)
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.aborted_at[request_id] = time.time()
        if request_id in self._aborts:
            self._aborts[request_id].set()

    def stats(self) -> dict[str, Any]:
        return {"max_model_len": 64, "kv_blocks_total": 8, "block_size": 16}

    def admission_capacity(self) -> int:
        return 8

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Any:
        if self.render is None:
            raise ValueError("this checkpoint has no chat template")
        self.rendered.append((messages, tools))
        return self.render(messages)

    async def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = True,
                       add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        return [ord(c) for c in prompt or ""]

    async def detokenize(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))

    def chat_template(self) -> Any:
        return self.template

    async def output_text(self, prompt_token_ids: list[int], token_ids: list[int], params: SamplingParams) -> str:
        """`texts[(prompt ids, token ids)]`: what a resumed request already sent, as the engine would have."""
        assert isinstance(params, SamplingParams), params
        return self.texts[(tuple(prompt_token_ids), tuple(token_ids))]

    def prompt_progress(self) -> dict[str, Any]:
        return {}

    def take_step_records(self) -> list[Any]:
        return []

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(self.defaults)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [f"<{t}>" for t in token_ids]


@asynccontextmanager
async def scripted_worker(engine: ScriptedEngine, redis_url: str, **config: Any) -> AsyncIterator[Worker]:
    """A worker serving in this process on `engine` until the block exits."""
    config = {"heartbeat_s": 0.2, "claim_idle_s": 5.0, "grace_s": 2.0, **config}
    worker = Worker(engine, WorkerConfig(redis_url=redis_url, model_name="scripted", **config))
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        with anyio.fail_after(10):
            await worker.ready.wait()
        try:
            yield worker
        finally:
            worker.request_stop()
