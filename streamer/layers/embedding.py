"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamer.layers.cpu_gemm import linear
from streamer.layers.linear import narrow
from streamer.parallel_state import get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.vocab_size = vocab_size
        # Pad so every rank has the same slice; padded rows are never looked up or sampled.
        self.per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = max(0, min(self.per_rank, self.vocab_size - self.vocab_start))
        param.data[:size].copy_(narrow(loaded, 0, self.vocab_start, size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.packed: torch.Tensor | None = None  # CPU: oneDNN's copy of the weight (cpu_gemm.pack_model)
        self.weight_shared = False  # set when tied to the embedding, whose dense weight must stay

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits `[N, vocab]`, gathered from all ranks."""
        logits = self.tp.all_gather_last_dim(linear(hidden, self.weight, None, self.packed))
        return logits[:, : self.vocab_size]
