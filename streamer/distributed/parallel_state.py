"""Tensor-parallel group state. At size 1 (the default) every collective is a no-op, so the
Megatron-style layers run unchanged on one device and tensor parallelism only adds processes."""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1


def init_tensor_parallel(rank: int, world_size: int) -> None:
    """Record this process's place; the caller has already run `dist.init_process_group`."""
    global _rank, _world_size
    _rank, _world_size = rank, world_size


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension (vocab-parallel logits)."""
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator
