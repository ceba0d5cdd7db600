"""A long float32 CPU step's MLP runs in row slices (streamer/models/llama.py: CPU_MLP_ROWS); the
rows must come out as from one call, including the last, shorter slice. bfloat16 runs whole."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from streamer.attention.cpu_backend import CpuBackend
from streamer.layers.cpu_gemm import pack_model
from streamer.models.llama import CPU_MLP_ROWS, LlamaMLP


def _mlp(dtype: torch.dtype) -> LlamaMLP:
    torch.manual_seed(0)
    mlp = LlamaMLP(SimpleNamespace(hidden_size=64, intermediate_size=160), CpuBackend())
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    mlp.to(dtype)
    pack_model(mlp, batch_hint=64)  # as the model runner does: oneDNN's packed weights
    return mlp


def test_sliced_mlp_equals_one_call():
    rows = CPU_MLP_ROWS[torch.float32]
    mlp = _mlp(torch.float32)
    x = torch.randn(2 * rows + 37, 64)
    sliced = mlp(x)
    whole = mlp._mlp(x)
    assert sliced.shape == x.shape
    # The same products per row; a GEMM's blocking may differ with the number of rows, so not
    # bit for bit: float32 summation order (~1e-7 relative).
    assert ((sliced - whole).norm() / whole.norm()).item() < 1e-6
    assert torch.equal(mlp(x[:rows]), mlp._mlp(x[:rows]))  # up to one slice: one call


def test_bfloat16_mlp_runs_whole():
    """bfloat16 takes no slices: the output of a step longer than float32's slice is bit-equal
    to one call (slices would change the GEMMs' blocking and so their sums)."""
    assert torch.bfloat16 not in CPU_MLP_ROWS
    mlp = _mlp(torch.bfloat16)
    x = torch.randn(2 * CPU_MLP_ROWS[torch.float32] + 37, 64).to(torch.bfloat16)
    calls = []
    mlp.gate_up_proj.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    assert torch.equal(mlp(x), mlp._mlp(x))
    assert calls == [len(x), len(x)]  # the sliced path would have made three calls for each
