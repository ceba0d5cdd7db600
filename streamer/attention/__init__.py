"""Attention backends. `get_backend(name, device)` picks one: "auto" means triton on CUDA and
cpu (the torch references plus a compiled decode kernel) on the CPU; "torch" is the pure
reference."""

from __future__ import annotations

import torch

from streamer.attention.backend import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        from streamer.attention.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "torch":
        from streamer.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        from streamer.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention_backend {name!r}: expected 'auto', 'cpu', 'torch' or 'triton'")
