"""The worker's seam to the engine: exactly the methods it calls. `streamer.AsyncEngine` has them;
tests/system/test_layering.py checks that its signatures match."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from streamer import RequestOutput, SamplingParams
from streamer.lora import LoRARequest
from streamer.outputs import PromptProgress, StepRecord
from streamer.pooling import PoolingParams
from streamer.prompts import TokenizedPrompt


class Engine(Protocol):
    def generate(self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0,
                 resume_token_ids: list[list[int]] | None = None, session: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Deltas of one request; raises ValueError / QueueFullError before the first if rejected
        (an adapter that cannot be served included). Closing the generator early aborts the request.
        Calls of one `session` (a conversation, an agent) queue behind sessions that have had less
        service so far. `lora_request`: the adapter it runs under (None: the base model)."""
        ...

    async def embed(self, prompt: Any, params: PoolingParams, request_id: str, priority: int = 0,
                    session: str | None = None) -> RequestOutput:
        """The embedding of a prompt, computed in the engine's batch (its `embedding`; `error` set when the
        engine could not run it; neither when aborted). ValueError / QueueFullError when refused."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def admission_capacity(self) -> int:
        """How many more requests the engine can take now without queueing."""
        ...

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                          ) -> TokenizedPrompt:
        """The checkpoint's chat template applied (with the function definitions `tools`) and tokenized
        (ValueError when it has none, or when the result is too long for the model)."""
        ...

    async def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = True,
                       add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """Token ids as /tokenize counts them (workers/worker/tasks.py)."""
        ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    def chat_template(self) -> Any:
        """The checkpoint's chat template (a string, a dict of named ones, or None)."""
        ...

    async def output_text(self, prompt_token_ids: list[int], token_ids: list[int], params: SamplingParams) -> str:
        """The text the engine streams for `token_ids` sampled after that prompt (what a resumed
        request already sent)."""
        ...

    def prompt_progress(self) -> dict[str, PromptProgress]:
        """Requests still computing their prompt (fresh to a fraction of a second), by id."""
        ...

    def take_step_records(self) -> list[StepRecord]:
        """The engine steps run since the last call (what ran, where the time went), oldest first."""
        ...

    def sampling_defaults(self) -> dict[str, Any]:
        """The checkpoint's own sampling parameters (its generation_config.json), for jobs that
        leave them out."""
        ...

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone (for the text beside a log-prob)."""
        ...
