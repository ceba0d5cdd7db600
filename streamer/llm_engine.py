"""The synchronous engine: requests in, one scheduler iteration per `step()`, deltas out.

A step is schedule -> execute -> update -> build outputs: the scheduler owns every sequence and
its blocks, the executor runs the model, the output processor turns tokens into text."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

import torch

from streamer.config import EngineConfig
from streamer.errors import ConfigError, GrammarError
from streamer.executor import make_executor
from streamer.fault_isolation import execute_isolated
from streamer.generation_defaults import generation_defaults
from streamer.grammar import GrammarCompiler
from streamer.grammar_masks import Budgets
from streamer.lora.request import LoRARequest
from streamer.model_config import ModelConfig
from streamer.output_processor import OutputProcessor
from streamer.outputs import PromptProgress, RequestOutput, StepRecord
from streamer.pooling import PREFILL_ONLY, ModelPooling, PoolingParams, PoolingState
from streamer.prompts import PromptProcessor, TokenizedPrompt
from streamer.request import Request, Sequence
from streamer.sampler import Sampler
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler, SchedulerConfig
from streamer.scheduler_output import SchedulerOutput
from streamer.spec_decode.proposer import make_proposer


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA device is available; use --device cpu")
    return device


STEP_RECORDS = 4096  # kept until taken: a reader that stops taking them loses only the oldest
MASK_WAIT_S = 0.01  # a step with nothing to run but sequences waiting for their masks sleeps this long at most


class LLMEngine:
    """Not thread-safe: one thread drives it (AsyncEngine runs it on its own thread)."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.model_config = ModelConfig.load(config.model, config.dtype, self.device, config.max_model_len)
        # Handed the config, AutoTokenizer does not resolve it again (hf_config.py: a second of imports).
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_config.path),
                                                       config=self.model_config.hf_config)
        self.eos_token_ids = frozenset(_eos_token_ids(self.model_config.path, self.tokenizer))
        self.generation_defaults = generation_defaults(self.model_config.path)
        self.pooling = ModelPooling.load(self.model_config.path, self.model_config.hf_config, config.pooling)
        self.executor = make_executor(config, self.model_config, self.device, Sampler(self.eos_token_ids, config.seed))
        # A sequence can never outgrow the whole cache, so cap its length there.
        self.max_model_len = min(self.model_config.max_model_len, self.executor.num_kv_blocks * config.block_size)
        spec = config.speculative
        self.proposer = make_proposer(config, spec, self.model_config, self.device, self.executor.num_kv_blocks) \
            if spec else None
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=self.executor.num_kv_blocks, block_size=config.block_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching, max_waiting_requests=config.max_waiting_requests,
            max_waiting_tokens=config.max_waiting_tokens, eos_token_ids=self.eos_token_ids,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            sliding_window=self.model_config.kv_window, max_loras=config.max_loras),
            proposer=self.proposer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prompts = PromptProcessor(self.tokenizer, self.model_config.hf_config.vocab_size, self.max_model_len)
        self.step_records: deque[StepRecord] = deque(maxlen=STEP_RECORDS)  # take_step_records() drains it
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._num_steps = 0

    # ---- requests in -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict[str, Any] | TokenizedPrompt) -> TokenizedPrompt:
        """The prompt checked against the model (ValueError when it does not fit): thread-safe, so
        callers can tokenize away from the thread that steps the engine."""
        return self.prompts.tokenize(prompt)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The checkpoint's chat template with the generation prompt, as token ids."""
        return self.prompts.chat(messages, tools).token_ids

    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any] | TokenizedPrompt,
                    params: SamplingParams | PoolingParams, priority: int = 0,
                    resume_token_ids: list[list[int]] | None = None, session: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. Its `session` (a conversation or an agent) is ranked in the waiting
        queue by the service the session has had so far: fresh sessions go ahead of heavy ones.
        With `lora_request` it runs under that adapter, read and checked here (ValueError if it
        cannot be served) and put in a device slot when it first runs."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            if resume_token_ids or lora_request is not None:
                raise ValueError("an embedding request takes no resume_token_ids and no LoRA adapter")
            self._add_pooling(request_id, prompt, params, priority, session)
            return
        if not self.model_config.generates:
            raise ValueError("this checkpoint has no LM head (an embedding model): it serves embeddings only")
        tokenized = self.prompts.tokenize(prompt)
        tokens, text = tokenized.token_ids, tokenized.text
        resume = resume_token_ids or []
        if len(resume) > params.n:
            raise ValueError("resume_token_ids has more entries than the request has samples")
        if resume and params.use_beam_search:
            raise ValueError("beam search requests cannot be resumed")
        vocab = self.model_config.hf_config.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:  # they index the logits: refused here, not in the middle of a step
            raise ValueError(f"stop token id {outside[0]} is outside the vocabulary [0, {vocab})")
        seqs = [Sequence(request_id=request_id, index=i, token_ids=tokens + list(resume[i] if i < len(resume) else []),
                         num_prompt_tokens=len(tokens), params=params, priority=priority, session=session)
                for i in range(params.n)]
        if lora_request is not None:
            self._check_lora(lora_request)
            for seq in seqs:
                seq.lora = lora_request
        if params.structured_outputs is not None:
            self._constrain(seqs, params.structured_outputs)
        request = Request(request_id, tokens, params, seqs, text)
        self.scheduler.add_request(request, resumed=bool(resume))
        self.output_processor.add_request(request, resume)

    def _add_pooling(self, request_id: str, prompt: str | list[int] | dict[str, Any] | TokenizedPrompt,
                     params: PoolingParams, priority: int, session: str | None) -> None:
        """An embedding: one sequence that computes its prompt (the whole model length: nothing is
        generated after it) and is pooled, in the same batches as generation (streamer/pooling.py)."""
        tokenized = self.prompts.tokenize(prompt, room=0)
        seq = Sequence(request_id=request_id, index=0, token_ids=list(tokenized.token_ids),
                       num_prompt_tokens=len(tokenized.token_ids), params=PREFILL_ONLY, priority=priority,
                       session=session, pooling=PoolingState(self.pooling.resolve(params)))
        request = Request(request_id, tokenized.token_ids, PREFILL_ONLY, [seq], tokenized.text)
        self.scheduler.add_request(request)
        self.output_processor.add_request(request, [])

    def _check_lora(self, lora: LoRARequest) -> None:
        manager = getattr(self.executor, "lora", None)
        if manager is None:
            raise ValueError("this engine serves no LoRA adapters (max_loras 0, or tensor parallelism: "
                             "adapters run with tensor_parallel_size 1)")
        manager.check(lora)

    def loaded_loras(self) -> list[str]:
        """Names of the adapters in device slots now (the worker advertises them for routing)."""
        manager = getattr(self.executor, "lora", None)
        return manager.loaded() if manager is not None else []

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured_outputs specs (xgrammar loads on the first constrained request)."""
        with self._grammars_lock:  # the first call may come from the tokenizing thread
            if self._grammars is None:
                c = self.config
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.model_config.hf_config.vocab_size, set(self.eos_token_ids),
                    Budgets(c.grammar_mask_budget_s, c.grammar_request_budget_s), c.grammar_compile_workers,
                    c.grammar_compile_timeout_s)
        return self._grammars

    def _constrain(self, seqs: list[Sequence], spec: dict[str, Any]) -> None:
        """A matcher per sequence, sharing the request's grammar budget; a resumed one is brought to
        where its tokens already are."""
        compiler = self.grammars()
        compiled = compiler.compile(spec)  # cached: AsyncEngine compiled it off this thread
        budget = compiler.budget(seqs[0].request_id)
        for seq in seqs:
            seq.grammar = compiler.matcher(compiled, budget)
            if not seq.grammar.replay(seq.output_token_ids):
                raise GrammarError("the tokens it resumes from do not match its structured_outputs")

    def abort_request(self, request_id: str, error: str | None = None, error_code: str | None = None) -> bool:
        """Stop a request; with `error`, its last output says why it failed (finish_reason "error"), and
        `error_code` whose fault it was (RequestOutput.error_code)."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        self.output_processor.abort(request, error, error_code)
        return True

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._grammars is not None:  # over a grammar budget: failed alone, before it runs again
            for request_id, reason in self._grammars.take_failures().items():
                self.abort_request(request_id, error=reason, error_code="invalid_params")
            self._grammars.masks.settle()
        t0 = time.monotonic()
        scheduled = self.scheduler.schedule()
        t1 = time.monotonic()
        if not scheduled.scheduled and self._grammars is not None:
            self._grammars.masks.wait(MASK_WAIT_S)  # only masks to wait for: sleep, not spin
        self._mark_scheduled(scheduled, t1)
        counts = scheduled.num_tokens, scheduled.num_prompt_tokens  # before the step moves them on
        step = execute_isolated(self.executor, scheduled)
        t2 = time.monotonic()
        for request_id, reason in step.failed.items():  # the others' step goes on without them
            self.abort_request(request_id, error=reason)
        core = self.scheduler.update_from_output(step.scheduled, step.model_output)
        outputs, stopped = self.output_processor.process(core)
        for seq in stopped:  # a stop string ended it: free its blocks before the next step
            self.scheduler.finish(seq)
        t3 = time.monotonic()
        _mark_outputs(outputs, t3)
        if scheduled.scheduled:
            self._num_steps += 1
            self.step_records.append(StepRecord(self._num_steps, t0, len(scheduled.scheduled), *counts,
                                                schedule_s=t1 - t0, execute_s=t2 - t1, process_s=t3 - t2,
                                                phases=getattr(self.executor, "phases", None)))
        return outputs

    def take_step_records(self) -> list[StepRecord]:
        """The steps run since the last call, oldest first (at most the last STEP_RECORDS kept)."""
        records = []
        while self.step_records:
            records.append(self.step_records.popleft())
        return records

    def _mark_scheduled(self, scheduled: SchedulerOutput, now: float) -> None:
        for item in scheduled.scheduled:
            request = self.scheduler.requests.get(item.seq.request_id)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no request holds; returns how many blocks were dropped."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the model's processes (tensor parallelism, grammar compiles); the engine is unusable afterwards."""
        self.executor.shutdown()
        if self.proposer is not None:
            self.proposer.shutdown()
        if self._grammars is not None:
            self._grammars.close()

    # ---- introspection -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.output_processor.has_pending()

    def admission_capacity(self) -> int:
        return self.scheduler.admission_capacity()

    def prompt_progress(self) -> dict[str, PromptProgress]:
        return self.scheduler.prompt_progress()

    def stats(self) -> dict[str, Any]:
        return {
            **self.scheduler.stats(),
            "block_size": self.config.block_size,
            "max_num_seqs": self.config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.model_config.dtype).replace("torch.", ""),
            "attention_backend": self.executor.backend.name,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "loras": self.loaded_loras(),
        }


def _mark_outputs(outputs: list[RequestOutput], now: float) -> None:
    for out in outputs:
        m = out.metrics
        if m is None:
            continue
        if m.first_token_time is None and any(c.token_ids for c in out.outputs):
            m.first_token_time = now
        if out.finished and m.finished_time is None:
            m.finished_time = now


def _eos_token_ids(root: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = root / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
