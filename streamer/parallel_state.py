"""Tensor-parallel group state.

Each layer captures the group that is current while the model is built (`building_with(group)`)
and runs its collectives on that group. The default group has size 1 and every collective is a
no-op, so the Megatron-style layers run unchanged on one device; and several engines (one with
tensor parallelism, one without) can live in one process without sharing global state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class TPGroup:
    """This process's place in a tensor-parallel group, and the process group its collectives
    run on (`None` at size 1). The process group is a backend object (gloo or NCCL) used
    directly, so it needs no global `init_process_group`."""

    def __init__(self, rank: int = 0, size: int = 1, pg: Any = None) -> None:
        if size > 1 and pg is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a process group")
        self.rank, self.size, self.pg = rank, size, pg

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            self.pg.allreduce(x).wait()
        return x

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        self.pg.allreduce(t, dist.ReduceOp.MIN).wait()
        return int(t.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
_current = SINGLE
_lock = threading.RLock()


@contextlib.contextmanager
def building_with(group: TPGroup) -> Iterator[TPGroup]:
    """Make `group` the one that layers constructed inside this block capture."""
    global _current
    with _lock:
        previous, _current = _current, group
        try:
            yield group
        finally:
            _current = previous


def get_tp_group() -> TPGroup:
    return _current


def get_tp_rank() -> int:
    return _current.rank


def get_tp_size() -> int:
    return _current.size


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator
