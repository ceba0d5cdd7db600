"""streamer: a paged-KV, continuously batched LLM engine."""

from streamer.config import EngineConfig
from streamer.errors import QueueFullError
from streamer.outputs import CompletionOutput, RequestOutput
from streamer.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "QueueFullError", "PoolingParams"]


def __getattr__(name: str):  # heavy modules (torch, transformers) load on first use
    if name == "LLM":
        from streamer.llm import LLM

        return LLM
    if name == "LLMEngine":
        from streamer.llm_engine import LLMEngine

        return LLMEngine
    if name == "PoolingParams":
        from streamer.pooling import PoolingParams

        return PoolingParams
    if name == "AsyncEngine":
        from streamer.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
