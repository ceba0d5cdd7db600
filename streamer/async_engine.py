"""asyncio front of the engine. The step loop runs on its own thread, so the event loop (Redis,
WebSockets) never waits for the model and the model never waits for I/O. Requests and aborts
cross over through a command queue; outputs come back through one callback per step."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from streamer.config import EngineConfig
from streamer.detokenizer import IncrementalDetokenizer
from streamer.errors import EngineDeadError
from streamer.llm_engine import LLMEngine
from streamer.lora.request import LoRARequest
from streamer.outputs import PromptProgress, RequestOutput, StepRecord
from streamer.pooling import PoolingParams
from streamer.prompts import PromptProcessor, TokenizedPrompt
from streamer.sampling_params import SamplingParams

log = logging.getLogger("streamer.engine")

PROGRESS_EVERY_S = 0.25  # how fresh prompt_progress() is


@dataclass
class AddCommand:
    request_id: str
    prompt: Any
    params: SamplingParams | PoolingParams
    priority: int
    resume_token_ids: list[list[int]] | None
    stream: asyncio.Queue[RequestOutput | BaseException]  # where its outputs go
    accepted: asyncio.Future[None]  # settled once the engine took or refused it
    session: str | None = None
    lora_request: LoRARequest | None = None


@dataclass
class AbortCommand:
    request_id: str


class AsyncEngine:
    def __init__(self, config: EngineConfig | LLMEngine) -> None:
        self.engine = config if isinstance(config, LLMEngine) else LLMEngine(config)
        self._commands: queue.SimpleQueue[AddCommand | AbortCommand] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending_adds = 0
        self._error: BaseException | None = None
        self._stats: dict[str, Any] = self.engine.stats()
        self._capacity = self.engine.admission_capacity()
        self._progress: dict[str, PromptProgress] = {}
        self._progress_at = 0.0
        # Prompts are tokenized on a thread of their own, with a tokenizer of their own: a long prompt
        # then delays only its own request, never a step, and encoding never contends with the
        # engine thread's decoding.
        p = self.engine.prompts
        self._prompts = PromptProcessor(copy.deepcopy(p.tokenizer), p.vocab_size, p.max_model_len)
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-tokenize")
        # Compiles wait on their own threads (each on a time-limited compile process, grammar_compile.py):
        # a slow schema never holds up another request's tokenizing.
        self._compiling = ThreadPoolExecutor(max_workers=self.engine.config.grammar_compile_workers,
                                             thread_name_prefix="streamer-compile")

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> AsyncEngine:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="streamer-engine", daemon=True)
            self._thread.start()
        return self

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        # Tensor-parallel ranks are processes: stop and join them (a no-op on one device).
        await asyncio.to_thread(self.engine.shutdown)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self._compiling.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: Any, params: SamplingParams | PoolingParams, request_id: str, priority: int = 0,
                       resume_token_ids: list[list[int]] | None = None, session: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Deltas of one request; raises ValueError/QueueFullError before the first if rejected.
        Leaving the loop early (break, cancellation) aborts the request. Calls of a `session`
        queue behind calls of sessions that have had less service (LLMEngine.add_request). With
        `lora_request` it runs under that adapter (an adapter that cannot be served: ValueError). With
        PoolingParams it is an embedding: one finished output holding it (`embed`)."""
        if self._error is not None:
            raise EngineDeadError(f"engine stopped after an error: {self._error}")
        await self.start()
        assert self._loop is not None
        room = 0 if isinstance(params, PoolingParams) else 1  # an embedding generates nothing: it may fill the model
        prompt = await self._loop.run_in_executor(self._tokenizing, self._prompts.tokenize, prompt, room)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # compiled here, so the engine thread finds it cached
            await self._loop.run_in_executor(self._compiling, self._compile, params.structured_outputs)
        accepted: asyncio.Future[None] = self._loop.create_future()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending_adds += 1
        self._send(AddCommand(request_id, prompt, params, priority, resume_token_ids, stream, accepted, session,
                              lora_request))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: the engine drops it if it was taken
            raise
        finally:
            self._pending_adds -= 1
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def embed(self, prompt: Any, params: PoolingParams, request_id: str, priority: int = 0,
                    session: str | None = None) -> RequestOutput:
        """The embedding of a prompt, batched with generation (streamer/pooling.py): its `embedding`,
        or `error` set when the engine could not run it. ValueError/QueueFullError when refused."""
        last: RequestOutput | None = None
        async for out in self.generate(prompt, params, request_id, priority, session=session):
            last = out
        assert last is not None
        return last

    def _compile(self, spec: dict[str, Any]) -> None:
        self.engine.grammars().compile(spec)  # GrammarError (a ValueError) for a spec that does not compile

    def abort(self, request_id: str) -> None:
        """Abort from any thread; its blocks are freed before the next step runs."""
        self._send(AbortCommand(request_id))

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def admission_capacity(self) -> int:
        return max(0, self._capacity - self._pending_adds)

    def take_step_records(self) -> list[StepRecord]:
        """The engine steps run since the last call, oldest first (from any thread)."""
        return self.engine.take_step_records()

    def prompt_progress(self) -> dict[str, PromptProgress]:
        """Requests still computing their prompt, as of a step at most PROGRESS_EVERY_S ago."""
        return self._progress

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def sampling_defaults(self) -> dict[str, Any]:
        """The checkpoint's own sampling parameters, for requests that leave them out."""
        return dict(self.engine.generation_defaults)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone (a piece of a multi-byte character shows as U+FFFD)."""
        return [self.engine.tokenizer.decode([t]) for t in token_ids]

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                          ) -> TokenizedPrompt:
        """The checkpoint's chat template applied, tokenized off the event loop and the engine thread."""
        await self.start()
        assert self._loop is not None
        return await self._loop.run_in_executor(self._tokenizing, self._prompts.chat, messages, tools)

    async def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = True,
                       add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """Token ids of a text, or of messages through the chat template, as vLLM's /tokenize counts
        them: no length check (the caller compares with max_model_len). ValueError for messages
        without a chat template."""
        await self.start()
        assert self._loop is not None
        return await self._loop.run_in_executor(self._tokenizing, self._prompts.token_ids, prompt, messages, tools,
                                                add_special_tokens, add_generation_prompt, continue_final_message)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens kept, as vLLM's /detokenize); ValueError for an id
        outside the vocabulary."""
        await self.start()
        assert self._loop is not None
        return await self._loop.run_in_executor(self._tokenizing, self._prompts.text, token_ids)

    def chat_template(self) -> Any:
        """The checkpoint's chat template (a string, a dict of named ones, or None): what tells which
        format its tool calls come in (workers/worker/tool_parsers.py)."""
        return getattr(self.engine.tokenizer, "chat_template", None)

    async def output_text(self, prompt_token_ids: list[int], token_ids: list[int], params: SamplingParams) -> str:
        """The text this engine streams for `token_ids` sampled after that prompt: what a resumed request
        already sent, decoded as its detokenizer replays it (OutputProcessor.add_request)."""
        await self.start()
        assert self._loop is not None
        return await self._loop.run_in_executor(self._tokenizing, self._output_text, prompt_token_ids, token_ids,
                                                params)

    def _output_text(self, prompt_token_ids: list[int], token_ids: list[int], params: SamplingParams) -> str:
        detok = IncrementalDetokenizer(self._prompts.tokenizer.backend_tokenizer, prompt_token_ids, params)
        for t in token_ids:
            detok.append(t, check_stop=False)
        return detok.text

    def _send(self, command: AddCommand | AbortCommand) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._publish_stats()  # before delivery: callers then see capacity they can use
                    if outputs:
                        self._deliver(outputs)
                else:
                    self._publish_stats()
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
        except BaseException as exc:  # a bug or an OOM in the model: fail every stream loudly
            log.exception("engine step failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AbortCommand):
                self.engine.abort_request(command.request_id)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params, command.priority,
                                        command.resume_token_ids, command.session, command.lora_request)
            except Exception as exc:  # rejected: hand the reason to the caller
                self._call(_settle, command.accepted, exc)
                continue
            self._streams[command.request_id] = command.stream
            self._call(_settle, command.accepted, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batch.append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        if batch:
            self._call(_put_all, batch)

    def _fail_all(self, exc: BaseException) -> None:
        batch = [(stream, exc) for stream in self._streams.values()]
        self._streams.clear()
        self._call(_put_all, batch)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()
        self._capacity = self.engine.admission_capacity()
        now = time.monotonic()
        if now - self._progress_at >= PROGRESS_EVERY_S:  # a walk over the queues: not every step
            self._progress, self._progress_at = self.engine.prompt_progress(), now

    def _call(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)
