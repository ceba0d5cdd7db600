"""A long CPU step's MLP runs in row slices (streamer/models/llama.py: CPU_MLP_ROWS); the rows
must come out as from one call, including the last, shorter slice."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from streamer.attention.cpu_backend import CpuBackend
from streamer.layers.cpu_gemm import pack_model
from streamer.models.llama import CPU_MLP_ROWS, LlamaMLP


def test_sliced_mlp_equals_one_call():
    torch.manual_seed(0)
    mlp = LlamaMLP(SimpleNamespace(hidden_size=64, intermediate_size=160), CpuBackend())
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    pack_model(mlp, batch_hint=64)  # as the model runner does: oneDNN's packed weights
    x = torch.randn(2 * CPU_MLP_ROWS + 37, 64)
    sliced = mlp(x)
    whole = mlp._mlp(x)
    assert sliced.shape == x.shape
    # The same products per row; a GEMM's blocking may differ with the number of rows, so not
    # bit for bit: float32 summation order (~1e-7 relative).
    assert ((sliced - whole).norm() / whole.norm()).item() < 1e-6
    assert torch.equal(mlp(x[:CPU_MLP_ROWS]), mlp._mlp(x[:CPU_MLP_ROWS]))  # up to one slice: one call
