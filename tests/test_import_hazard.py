"""transformers probes for Hugging Face's own `kernels` package when a model class is imported;
with our packages importable it finds ours. That must stay harmless."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_model_runs_with_our_kernels_package_importable(tmp_path, llama_ckpt):
    script = f"""
import sys, importlib.util
sys.path.insert(0, {str(ROOT)!r})
assert importlib.util.find_spec("kernels").origin.startswith({str(ROOT)!r})
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.utils import import_utils
assert not import_utils.is_kernels_available(), "our kernels package must not pass for HF's"
model = AutoModelForCausalLM.from_pretrained({str(llama_ckpt)!r})
out = model(torch.tensor([[5, 6, 7]])).logits
assert out.shape == (1, 3, 512) and torch.isfinite(out).all()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_kernels_package_is_cheap_to_import():
    code = "import sys, kernels; bad = {'triton', 'transformers'} & set(sys.modules); print(sorted(bad))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
