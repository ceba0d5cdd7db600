"""What runs the model for the engine: one in-process ModelRunner, or tensor-parallel ranks."""

from __future__ import annotations

from typing import Protocol

import torch

from streamer.attention.backend import AttentionBackend
from streamer.config import EngineConfig
from streamer.model_config import ModelConfig
from streamer.request import Sequence
from streamer.sampler import Sampler, SamplerOutput
from streamer.scheduler_output import ScheduledSeq


class Executor(Protocol):
    """The runner's surface, as the engine uses it."""

    num_kv_blocks: int
    backend: AttentionBackend

    def execute(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None
                ) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; the sequences that sampled, and what they sampled (in order)."""
        ...

    def shutdown(self) -> None:
        ...


def make_executor(config: EngineConfig, model_config: ModelConfig, device: torch.device, sampler: Sampler) -> Executor:
    if config.tensor_parallel_size == 1:
        from streamer.model_runner import ModelRunner

        return ModelRunner(config, model_config, device, sampler)
    from streamer.distributed.tp_executor import TPExecutor

    return TPExecutor(config, model_config, device, sampler)
