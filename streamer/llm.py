"""Offline batch generation, with vLLM's `LLM` interface."""

from __future__ import annotations

from typing import Any

from streamer.config import EngineConfig
from streamer.llm_engine import LLMEngine
from streamer.lora.request import LoRARequest
from streamer.outputs import CompletionOutput, RequestOutput
from streamer.pooling import PoolingParams
from streamer.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._next_id = 0

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | PoolingParams | list[SamplingParams | PoolingParams] | None = None,
                 priorities: list[int] | None = None,
                 lora_request: LoRARequest | None | list[LoRARequest | None] = None) -> list[RequestOutput]:
        """Run all prompts to completion; outputs are whole (not deltas), in prompt order.
        `lora_request`: one adapter for all prompts, or one per prompt (None: the base model), as vLLM's."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one lora_request, or one per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, prompt, p, priority=priorities[i] if priorities else 0,
                                    lora_request=loras[i])
            ids.append(request_id)
        merged: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                _merge(merged, delta)
        return [merged[i] for i in ids]

    def embed(self, prompts: Prompt | list[Prompt], params: PoolingParams | None = None) -> list[RequestOutput]:
        """Embeddings of the prompts (each output's `embedding`), in prompt order, as vLLM's `LLM.embed`."""
        return self.generate(prompts, params or PoolingParams())

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine's processes (tensor-parallel ranks); the LLM is unusable afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer


def _merge(merged: dict[str, RequestOutput], delta: RequestOutput) -> None:
    current = merged.get(delta.request_id)
    if current is None:
        current = merged[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt_token_ids, [], False, delta.num_cached_tokens, delta.prompt)
    by_index = {c.index: c for c in current.outputs}
    for c in delta.outputs:
        acc = by_index.get(c.index)
        if acc is None:
            acc = by_index[c.index] = CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None else None)
            current.outputs.append(acc)
        acc.text += c.text
        acc.token_ids.extend(c.token_ids)
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
        if c.logprobs is not None and acc.logprobs is not None:
            acc.logprobs.extend(c.logprobs)
    current.outputs.sort(key=lambda c: c.index)
    current.finished = delta.finished
    current.num_cached_tokens = delta.num_cached_tokens
    current.error = delta.error
    current.embedding = delta.embedding
