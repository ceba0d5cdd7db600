"""Chooses what runs the model: one in-process ModelRunner, or tensor-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch

from streamer.config import EngineConfig
from streamer.model_config import ModelConfig
from streamer.sampler import Sampler


def make_executor(config: EngineConfig, model_config: ModelConfig, device: torch.device, sampler: Sampler) -> Any:
    """Anything with ModelRunner's surface: `execute(scheduled, block_copies)`, `num_kv_blocks`,
    `backend.name`, `shutdown()`."""
    if config.tensor_parallel_size == 1:
        from streamer.model_runner import ModelRunner

        return ModelRunner(config, model_config, device, sampler)
    from streamer.distributed.tp_executor import TPExecutor

    return TPExecutor(config, model_config, device, sampler)
