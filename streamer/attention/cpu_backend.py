"""The CPU backend: the torch references, with decode attention compiled for the CPU (it reads
K/V in place instead of gathering a dense copy first). Falls back to the reference if the
kernel cannot be built here."""

from __future__ import annotations

import torch

from kernels.cpu_attention import load, paged_decode_attention_cpu
from streamer.attention.torch_backend import TorchBackend


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.compiled = load() is not None

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
               out: torch.Tensor) -> None:
        if not self.compiled:
            return super().decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out)
        out.copy_(paged_decode_attention_cpu(query, key_cache, value_cache, block_tables, seq_lens, scale))
