"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, and
the experts run as one grouped computation per layer.

The experts' weights are stacked: `w13` `[E, 2 * I, H]` (each expert's gate rows, then its up
rows) and `w2` `[E, H, I]`. A step's (token, expert) pairs are sorted by expert, so each expert's
tokens are one contiguous segment, and each projection is one grouped product over all experts
(kernels/grouped_gemm.py); each output row, times its routing weight, is added back to its
token. On the CPU the model runner packs the experts once (`Experts.pack_for_cpu`, beside the
dense layers' oneDNN packing) and the whole gate/up, SiLU-mul and down is one compiled call per
layer (kernels/grouped_gemm.py: moe_experts). With tensor parallelism every rank holds every
expert with its own slice of the intermediate dimension I (as vLLM splits it): gate/up rows and
down columns, and the layer's output is all-reduced, like a dense MLP's.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from streamer_kernels.grouped_gemm import grouped_mm, moe_experts_packable, moe_layer, pack_experts, sort_by_expert
from torch import nn

from streamer.attention.backend import AttentionBackend
from streamer.layers.linear import narrow
from streamer.parallel_state import divide, get_tp_group


class Router(nn.Module):
    """Router logits in the hidden dtype, softmax in float32 over all experts, the top k; with
    `renormalize` the k weights are divided by their sum (Mixtral always, Qwen3-MoE with
    norm_topk_prob). `weights_in_hidden_dtype`: Qwen3-MoE rounds the weights to the hidden dtype
    before they scale the experts' outputs, Mixtral keeps them in float32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 weights_in_hidden_dtype: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_in_hidden_dtype = weights_in_hidden_dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights `[T, k]`, experts `[T, k]` int64) of each token."""
        logits = F.linear(x, self.weight)
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_hidden_dtype else weights), experts


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_experts = num_experts
        self.per_rank = divide(intermediate_size, self.tp.size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.per_rank, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.per_rank), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.backend = backend
        self.packed_experts: tuple[torch.Tensor, torch.Tensor] | None = None  # pack_for_cpu's (w13, w2)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: tuple[int, int]) -> None:
        """`shard_id` (expert, part): part 0 gate, 1 up (rows of w13), 2 down (w2)."""
        expert, part = shard_id
        start = self.tp.rank * self.per_rank
        if part == 2:
            param.data[expert].copy_(narrow(loaded, 1, start, self.per_rank))
        else:
            param.data[expert, part * self.per_rank:(part + 1) * self.per_rank].copy_(
                narrow(loaded, 0, start, self.per_rank))

    def pack_for_cpu(self) -> bool:
        """The weights in the compiled kernel's packed layout, the stacked copies dropped (as the
        dense layers drop theirs for oneDNN's); False where the kernel does not run them."""
        if self.packed_experts is not None or not moe_experts_packable(self.w13.dtype, self.w13.device):
            return False
        self.packed_experts = pack_experts(self.w13.data, self.w2.data)
        self.w13.data = torch.empty(0, dtype=self.w13.dtype)
        self.w2.data = torch.empty(0, dtype=self.w2.dtype)
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(x), this rank's share of it."""
        if self.packed_experts is not None:  # the whole of this method in one compiled call
            return moe_layer(x, weights, experts, self.packed_experts)
        order, rows, offs = sort_by_expert(experts, self.num_experts)  # pairs grouped by expert, tokens in order
        h = self.backend.silu_and_mul(grouped_mm(x[rows], self.w13.transpose(1, 2), offs))
        y = grouped_mm(h, self.w2.transpose(1, 2), offs)
        y = (y * weights.flatten()[order, None]).to(x.dtype)
        # Each token's contributions are added in expert order, as transformers adds them.
        return torch.zeros_like(x).index_add_(0, rows, y)


class FusedMoE(nn.Module):
    """The MoE MLP: `gate` (the router, every rank whole) and `experts`."""

    def __init__(self, cfg: Any, num_experts: int, intermediate_size: int, renormalize: bool,
                 weights_in_hidden_dtype: bool, backend: AttentionBackend) -> None:
        super().__init__()
        self.gate = Router(cfg.hidden_size, num_experts, cfg.num_experts_per_tok, renormalize,
                           weights_in_hidden_dtype)
        self.experts = Experts(num_experts, cfg.hidden_size, intermediate_size, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts.tp.all_reduce(self.experts(x, weights, experts))


# A checkpoint's per-expert tensors: Qwen3-MoE's gate/up/down_proj, Mixtral's w1 (gate), w3 (up), w2 (down).
_EXPERT = re.compile(r"^(?:model\.)?(.*\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def expert_weight(name: str) -> tuple[str, tuple[int, int]] | None:
    """(our parameter, (expert, part)) for a checkpoint's per-expert tensor; None for the others."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, expert, proj = m.groups()
    part = _PART[proj]
    return f"{prefix}mlp.experts.{'w2' if part == 2 else 'w13'}", (int(expert), part)
