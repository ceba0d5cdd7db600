"""The dtype an engine picks when none is given: on the CPU bfloat16 only where the CPU multiplies
bfloat16 in hardware (AVX-512 BF16 or AMX), float32 elsewhere; on a GPU the checkpoint's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from streamer_kernels.cpu_features import cpu_flags, fast_bfloat16, flags_in

from streamer import LLMEngine
from streamer.config import EngineConfig
from streamer.model_config import _resolve_dtype

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\nbugs\t\t: spectre\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\n"


@pytest.mark.parametrize("cpuinfo, fast", [(SAPPHIRE_RAPIDS, True), (ZEN4, True), (ICE_LAKE, False),
                                           (AVX2_ONLY, False), ("", False)])
def test_bfloat16_is_fast_only_with_avx512_bf16_or_amx(cpuinfo: str, fast: bool) -> None:
    assert fast_bfloat16(flags_in(cpuinfo)) is fast


def test_this_cpus_flags_are_read() -> None:
    text = Path("/proc/cpuinfo").read_text()
    assert cpu_flags() == flags_in(text) and "fpu" in cpu_flags()


@pytest.mark.parametrize("stored", ["float32", "bfloat16", None])
def test_cpu_default_follows_the_cpu_not_the_checkpoint(stored: str | None) -> None:
    hf = SimpleNamespace(torch_dtype=stored)
    want = torch.bfloat16 if fast_bfloat16() else torch.float32
    assert _resolve_dtype(None, hf, torch.device("cpu")) == want
    assert _resolve_dtype("auto", hf, torch.device("cpu")) == want
    assert _resolve_dtype("float32", hf, torch.device("cpu")) == torch.float32


def test_gpu_default_is_the_checkpoints_half_type() -> None:
    cuda = torch.device("cuda")
    assert _resolve_dtype(None, SimpleNamespace(torch_dtype="float16"), cuda) == torch.float16
    assert _resolve_dtype(None, SimpleNamespace(torch_dtype="float32"), cuda) == torch.bfloat16


def test_an_engine_reports_the_dtype_it_chose(llama_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), num_kv_blocks=16))
    try:
        assert engine.stats()["dtype"] == ("bfloat16" if fast_bfloat16() else "float32")
    finally:
        engine.shutdown()
