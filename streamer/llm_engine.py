"""The synchronous engine: requests in, one scheduler iteration per `step()`, deltas out.

A step is schedule -> execute -> update -> build outputs: the scheduler owns every sequence and
its blocks, the executor runs the model, the output processor turns tokens into text."""

from __future__ import annotations

import json
from typing import Any

import torch

from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.executor import make_executor
from streamer.fault_isolation import execute_isolated
from streamer.model_config import ModelConfig
from streamer.output_processor import OutputProcessor
from streamer.outputs import PromptProgress, RequestOutput
from streamer.prompts import PromptProcessor, TokenizedPrompt
from streamer.request import Request, Sequence
from streamer.sampler import Sampler
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler, SchedulerConfig


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA device is available; use --device cpu")
    return device


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
        self.runner = make_executor(config, self.model_config, self.device, Sampler(self.eos_token_ids, config.seed))
        # A sequence can never outgrow the whole cache, so cap its length there.
        self.max_model_len = min(self.model_config.max_model_len, self.runner.num_kv_blocks * config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=self.runner.num_kv_blocks, block_size=config.block_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching, max_waiting_requests=config.max_waiting_requests,
            max_waiting_tokens=config.max_waiting_tokens, eos_token_ids=self.eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prompts = PromptProcessor(self.tokenizer, self.model_config.hf_config.vocab_size, self.max_model_len)

    # ---- requests in -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict[str, Any] | TokenizedPrompt) -> TokenizedPrompt:
        """The prompt checked against the model (ValueError when it does not fit): thread-safe, so
        callers can tokenize away from the thread that steps the engine."""
        return self.prompts.tokenize(prompt)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The checkpoint's chat template with the generation prompt, as token ids."""
        return self.prompts.chat(messages).token_ids

    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any] | TokenizedPrompt,
                    params: SamplingParams, priority: int = 0,
                    resume_token_ids: list[list[int]] | None = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
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
                         num_prompt_tokens=len(tokens), params=params, priority=priority) for i in range(params.n)]
        request = Request(request_id, tokens, params, seqs, text)
        self.scheduler.add_request(request, resumed=bool(resume))
        self.output_processor.add_request(request, resume)

    def abort_request(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request; with `error`, its last output says why it failed (finish_reason "error")."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        self.output_processor.abort(request, error)
        return True

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step = execute_isolated(self.runner, self.scheduler.schedule())
        for request_id, reason in step.failed.items():  # the others' step goes on without them
            self.abort_request(request_id, error=reason)
        core = self.scheduler.update_from_output(step.scheduled, step.model_output)
        outputs, stopped = self.output_processor.process(core)
        for seq in stopped:  # a stop string ended it: free its blocks before the next step
            self.scheduler.finish(seq)
        return outputs

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no request holds; returns how many blocks were dropped."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the model's processes (tensor parallelism); the engine is unusable afterwards."""
        self.runner.shutdown()

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
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.model_config.dtype).replace("torch.", ""),
            "attention_backend": self.runner.backend.name,
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }


def _eos_token_ids(root: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = root / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
