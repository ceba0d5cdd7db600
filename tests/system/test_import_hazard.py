"""Hugging Face's `kernels` package (a dependency of transformers, which imports it) and ours must
not shadow each other: ours installs as `streamer_kernels` from a kernels/ folder without an
`__init__.py`, so that even with the repository root first on sys.path `import kernels` is theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transformers_model_runs_from_the_repository_root(llama_ckpt):
    script = f"""
import importlib.util, sys
assert sys.path[0] in ("", {str(ROOT)!r})
spec = importlib.util.find_spec("kernels")
# Theirs, or (without it installed) a namespace portion nobody can import names from: never ours.
assert spec is None or spec.origin is None or not spec.origin.startswith({str(ROOT)!r}), spec
import streamer_kernels.rotary
assert streamer_kernels.rotary.__file__.startswith({str(ROOT / "kernels")!r})
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(llama_ckpt)!r})
out = model(torch.tensor([[5, 6, 7]])).logits
assert out.shape == (1, 3, 512) and torch.isfinite(out).all()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")

