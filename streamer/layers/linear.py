"""Megatron-style linear layers. Each parameter carries a `weight_loader` that copies this rank's
shard out of a checkpoint tensor (or a lazy safetensors slice, so a rank reads only its part)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from streamer.layers.cpu_gemm import linear
from streamer.parallel_state import divide, get_tp_group, get_tp_size


def narrow(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """`loaded[start:start+size]` along dim 0 or 1; works on tensors and safetensors slices."""
    if dim == 0:
        return loaded[start:start + size]
    return loaded[:, start:start + size]


def full(loaded: Any) -> torch.Tensor:
    return loaded[:]


def _starts(sizes: list[int]) -> list[int]:
    """Where each of consecutive parts of these sizes starts."""
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """`y = x W^T (+ b)` with W split by output rows across ranks; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.output_size_per_rank = divide(output_size, self.tp_size)
        self.weight = _param(self.output_size_per_rank, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(self.output_size_per_rank) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.packed: torch.Tensor | None = None  # CPU: oneDNN's copy of the weight (cpu_gemm.pack_model)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        param.data.copy_(narrow(loaded, 0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is None:  # one fused checkpoint tensor (Phi-3's gate_up_proj): its parts in order
            for part, start in enumerate(_starts(self.output_sizes)):
                self.weight_loader(param, narrow(loaded, 0, start, self.output_sizes[part]), part)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections split by attention heads. When there are fewer KV heads than
    ranks, each KV head is replicated on `tp_size / num_kv_heads` ranks."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(num_heads, tp)
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp)
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp, num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is None:  # one fused checkpoint tensor (Phi-3's qkv_proj): q, k, v of every head
            tp = self.tp_size
            sizes = [self.num_heads * self.head_size * tp] + [self.num_kv_heads * self.head_size * tp
                                                               // self.kv_replicas] * 2
            for part, start in zip("qkv", _starts(sizes)):
                self.weight_loader(param, narrow(loaded, 0, start, sizes["qkv".index(part)]), part)
            return
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, src_rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, src_rank = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, src_rank * size, size))


class RowParallelLinear(nn.Module):
    """`y = x W^T (+ b)` with W split by input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.input_size_per_rank = divide(input_size, self.tp_size)
        self.weight = _param(output_size, self.input_size_per_rank)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size) if bias else None
        self.packed: torch.Tensor | None = None  # CPU: oneDNN's copy of the weight (cpu_gemm.pack_model)
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[1]
        param.data.copy_(narrow(loaded, 1, self.tp_rank * size, size))

    def bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        param.data.copy_(full(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return y if self.bias is None else y + self.bias
