"""The synchronous engine: requests in, one scheduler iteration per `step()`, deltas out."""

from __future__ import annotations

import json
from typing import Any

import torch

from streamer.beam_engine import advance_beams, beam_output, new_beam_state
from streamer.block_manager import BlockManager
from streamer.config import EngineConfig
from streamer.detokenizer import IncrementalDetokenizer
from streamer.errors import ConfigError
from streamer.executor import make_executor
from streamer.model_config import ModelConfig
from streamer.outputs import CompletionOutput, RequestOutput
from streamer.request import Request, Sequence
from streamer.sampler import Sampler
from streamer.sampling_params import SamplingParams
from streamer.scheduler import ScheduledSeq, Scheduler
from streamer.stop_checker import finish_reason_after


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
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_config.path))
        self.eos_token_ids = _eos_token_ids(self.model_config.path, self.tokenizer)
        self.runner = make_executor(config, self.model_config, self.device, Sampler(self.eos_token_ids, config.seed))
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        # A sequence can never outgrow the whole cache, so cap its length there.
        self.max_model_len = min(self.model_config.max_model_len, self.runner.num_kv_blocks * config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.max_waiting_requests, config.max_waiting_tokens)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.counters = {"prompt_tokens_computed": 0, "generation_tokens": 0, "num_steps": 0,
                         "num_requests_finished": 0, "num_requests_aborted": 0, "max_step_tokens": 0,
                         "num_mixed_steps": 0, "num_partial_prefills": 0}

    # ---- requests in -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids, prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model_config.hf_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            return list(prompt), None
        raise ValueError("prompt must be a string, a list of token ids, or {'prompt_token_ids': [...]}")

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The checkpoint's chat template with the generation prompt, as token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams,
                    priority: int = 0, resume_token_ids: list[list[int]] | None = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        tokens, text = self.tokenize(prompt)
        if not tokens:
            raise ValueError("prompt is empty")
        if len(tokens) >= self.max_model_len:
            raise ValueError(f"prompt has {len(tokens)} tokens but the model allows at most "
                             f"{self.max_model_len - 1} (max_model_len {self.max_model_len}, one token "
                             "left to generate)")
        resume = resume_token_ids or []
        if len(resume) > params.n:
            raise ValueError("resume_token_ids has more entries than the request has samples")
        if resume and params.use_beam_search:
            raise ValueError("beam search requests cannot be resumed")
        self.scheduler.check_room(1 if not resume else params.n, len(tokens))
        seqs = [self._new_sequence(request_id, i, tokens, params, priority,
                                   resume[i] if i < len(resume) else []) for i in range(params.n)]
        request = self.requests[request_id] = Request(request_id, tokens, params, seqs, text)
        if params.use_beam_search:
            request.beam = new_beam_state(params, self.eos_token_ids, self.max_model_len - len(tokens))
        if resume:  # samples already diverged: each recomputes its own tokens (prefix cache shares)
            for seq in seqs:
                self.scheduler.add(seq)
        else:  # only the first sample computes the prompt; the others fork from it (shared blocks)
            seqs[0].pending_forks = seqs[1:]
            self.scheduler.add(seqs[0])

    def _new_sequence(self, request_id: str, index: int, tokens: list[int], params: SamplingParams,
                      priority: int, resumed: list[int]) -> Sequence:
        detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, tokens, params)
        for t in resumed:  # already streamed by an earlier run: replay the text state only
            detok.append(t, check_stop=False)
        detok.emitted = len(detok.text)
        return Sequence(request_id=request_id, index=index, token_ids=tokens + list(resumed),
                        num_prompt_tokens=len(tokens), params=params, detokenizer=detok, priority=priority)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._aborted.append(request)
        self.counters["num_requests_aborted"] += 1
        return True

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(r, r.sequences) for r in self._aborted]
        self._aborted.clear()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        sampled, result = self.runner.execute(sched.scheduled, sched.block_copies)
        self.counters["num_steps"] += 1
        self.counters["max_step_tokens"] = max(self.counters["max_step_tokens"], sched.num_tokens)
        self._count_step_shape(sched.scheduled)
        for item in sched.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            self.counters["prompt_tokens_computed"] += max(0, min(start + item.num_new_tokens,
                                                                  seq.num_prompt_tokens) - start)
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            self._fork(item)
        touched: dict[str, list[Sequence]] = {}
        beams: dict[str, Request] = {}
        for i, seq in enumerate(sampled):
            if seq.params.use_beam_search:
                seq.beam_logprobs = result.beam_logprobs[i]
                beams[seq.request_id] = self.requests[seq.request_id]
                continue
            self._append_token(seq, result.token_ids[i], result.logprobs[i])
            touched.setdefault(seq.request_id, []).append(seq)
        for request in beams.values():
            if advance_beams(request, self.block_manager, self.scheduler):
                outputs.append(beam_output(request, self.tokenizer))
                del self.requests[request.request_id]
                self.counters["num_requests_finished"] += 1
        for request_id, seqs in touched.items():
            request = self.requests[request_id]
            outputs.append(self._output(request, seqs))
            if request.is_finished:
                del self.requests[request_id]
                self.counters["num_requests_finished"] += 1
        return outputs

    def _fork(self, item: ScheduledSeq) -> None:
        """Parallel samples share the computed prompt's blocks; the first divergent write into
        the shared, partly filled last block copies it (see BlockManager.allocate)."""
        for child in item.forks:
            self.block_manager.fork(item.seq, child)
            self.scheduler.start_running(child)
        item.seq.pending_forks = []

    def _count_step_shape(self, scheduled: list[ScheduledSeq]) -> None:
        """Count steps mixing prefill and decode work, and prompt chunks cut short by the budget."""
        prefill = [s for s in scheduled if s.seq.num_computed_tokens < s.seq.num_prompt_tokens]
        if prefill and len(prefill) < len(scheduled):
            self.counters["num_mixed_steps"] += 1
        self.counters["num_partial_prefills"] += sum(1 for s in prefill if not s.samples)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if logprobs is not None:
            seq.pending_logprobs.append(logprobs)
        self.counters["generation_tokens"] += 1
        check_stop = seq.num_output_tokens >= seq.params.min_tokens
        stop_str = seq.detokenizer.append(token, check_stop)
        reason = finish_reason_after(seq, token, stop_str, self.eos_token_ids, self.max_model_len)
        if reason is not None and stop_str is None:
            # Ending for another reason: text still held back as incomplete UTF-8 may hold a stop string.
            late_stop = seq.detokenizer.flush(check_stop)
            if late_stop is not None:
                reason = ("stop", late_stop)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            self.scheduler.finish(seq)

    def _output(self, request: Request, seqs: list[Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.delta(finished=seq.is_finished),
                token_ids=seq.pending_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            ))
            seq.pending_token_ids, seq.pending_logprobs = [], []
        return RequestOutput(request.request_id, request.prompt_token_ids, completions,
                             finished=request.is_finished,
                             num_cached_tokens=min(s.num_cached_tokens for s in request.sequences),
                             prompt=request.prompt)

    def shutdown(self) -> None:
        """Stop the model's processes (tensor parallelism); the engine is unusable afterwards."""
        self.runner.shutdown()

    # ---- introspection -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def admission_capacity(self) -> int:
        """How many more requests can start soon: none while some already wait, and none while
        the free blocks would not even give every running sequence one more block."""
        s = self.scheduler
        if len(s.waiting) or self.block_manager.num_free_blocks <= len(s.running):
            return 0
        return max(0, min(s.max_num_seqs - len(s.running), s.max_waiting_requests))

    def stats(self) -> dict[str, Any]:
        running = self.scheduler.running
        return {
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_requests": len(self.requests),
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_used": self.block_manager.num_used_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "kv_utilization": self.block_manager.utilization(running),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": self.scheduler.prefix_cache_query_tokens,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "device": str(self.device),
            "dtype": str(self.model_config.dtype).replace("torch.", ""),
            "attention_backend": self.runner.backend.name,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            **self.counters,
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
