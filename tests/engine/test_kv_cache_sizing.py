"""The KV cache sized from measured memory (issue 39, part 3): the arithmetic of
streamer/kv_cache_sizing.py fed with numbers measured on this machine (its RAM, the peak of a real
profiling forward of a model, that model's block size), and the runner's CPU sizing end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamer import LLMEngine
from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.kv_cache_sizing import GIB, GpuMemory, KVCacheMemoryError, cpu_kv_blocks, gpu_kv_blocks
from streamer.memory_probe import available_memory
from streamer.model_config import ModelConfig
from streamer.model_runner import ModelRunner
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

VOCAB = 32000  # wide enough that the LM head's rows are a visible share of the forward's peak


@pytest.fixture(scope="module")
def wide_vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("wide"), TinyModelSpec(vocab_size=VOCAB), seed=3)


def runner(ckpt: Path, **options: object) -> ModelRunner:
    """A CPU runner whose cache size is given, so building it measures nothing."""
    config = EngineConfig(model=str(ckpt), dtype="float32", device="cpu", num_kv_blocks=4, **options)
    model_config = ModelConfig.load(config.model, config.dtype, torch.device("cpu"), config.max_model_len)
    return ModelRunner(config, model_config, torch.device("cpu"), None)


def total_memory() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


# Measured in a fresh process: on the CPU the peak is the growth of the process's resident memory,
# and in a process that already freed larger buffers (a long test session) the allocator reuses
# them without growing at all.
_PEAKS = """
import json, sys, torch
from test_kv_cache_sizing import runner
heavy = runner(sys.argv[1], max_num_seqs=256, max_num_batched_tokens=2048)
peak = heavy.profile_forward_peak()
light = runner(sys.argv[1], max_num_seqs=1, max_num_batched_tokens=16).profile_forward_peak()
print(json.dumps([peak, light, heavy.key_caches[0].shape[0]]))
"""


def test_profiling_forward_peak_is_measured_and_grows_with_the_token_budget(wide_vocab_ckpt: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _PEAKS, str(wide_vocab_ckpt)], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              map(str, (root, root / "tests", Path(__file__).parent)))})
    assert done.returncode == 0, done.stderr[-2000:]
    peak, light, cache_blocks = json.loads(done.stdout.strip().splitlines()[-1])
    # 256 sampling sequences: their float32 logits [256, 32000] exist at once, a floor on the peak.
    assert peak >= 256 * VOCAB * 4, peak
    assert peak < 1 * GIB  # a tiny model: a gross over-count (the whole process, say) would pass a floor alone
    assert light < peak / 4, (light, peak)
    assert cache_blocks == 0  # the profile's own cache is dropped


def test_gpu_arithmetic_on_measured_numbers(wide_vocab_ckpt: Path) -> None:
    r = runner(wide_vocab_ckpt, max_num_seqs=64, max_num_batched_tokens=512)
    peak = r.profile_forward_peak()
    per_block = r._bytes_per_block()
    free, total = available_memory(), total_memory()
    mem = GpuMemory(free=free, total=total, forward_peak=peak)
    blocks = gpu_kv_blocks(mem, 0.9, per_block, max_useful=1 << 40, max_num_batched_tokens=512)
    budget = free - 0.1 * total - peak
    assert blocks * per_block <= budget < (blocks + 1) * per_block
    # The measured peak and a CUDA graph reserve each come out of the cache, block for block.
    reserved = gpu_kv_blocks(dataclasses.replace(mem, graph_reserve=100 * per_block), 0.9, per_block, 1 << 40, 512)
    assert blocks - reserved in (100, 101)
    eager_free = gpu_kv_blocks(dataclasses.replace(mem, forward_peak=0), 0.9, per_block, 1 << 40, 512)
    assert eager_free - blocks in (peak // per_block, peak // per_block + 1)
    assert gpu_kv_blocks(mem, 0.9, per_block, max_useful=7, max_num_batched_tokens=512) == 7


def test_a_model_that_does_not_fit_fails_with_one_line_naming_the_numbers(wide_vocab_ckpt: Path) -> None:
    r = runner(wide_vocab_ckpt, max_num_seqs=64, max_num_batched_tokens=512)
    peak, per_block = r.profile_forward_peak(), r._bytes_per_block()
    total = total_memory()
    # Free memory just short of what utilization keeps back plus the measured peak: no block fits.
    free = int(0.1 * total) + peak + per_block - 1
    with pytest.raises(KVCacheMemoryError) as err:
        gpu_kv_blocks(GpuMemory(free=free, total=total, forward_peak=peak), 0.9, per_block, 1 << 40, 512)
    message = str(err.value)
    assert "\n" not in message
    for number in (f"{free / GIB:.2f} GiB free", f"of {total / GIB:.2f} GiB", f"{peak / GIB:.2f} GiB for activations",
                   "max_num_batched_tokens=512", f"{per_block} bytes", "gpu_memory_utilization 0.9"):
        assert number in message, (number, message)
    assert isinstance(err.value, ConfigError)  # the worker reports it as one line, no traceback


def test_cpu_cache_from_kv_cache_memory_or_available_ram(llama_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), device="cpu", dtype="float32", kv_cache_memory_gb=0.001))
    per_block = engine.executor._bytes_per_block()
    assert engine.stats()["kv_blocks_total"] == int(0.001 * GIB // per_block)
    engine.shutdown()
    available = available_memory()
    assert cpu_kv_blocks(None, available, 1, per_block, 1 << 40) == min(2 * GIB, available // 4) // per_block
    assert cpu_kv_blocks(None, available, 2, per_block, 1 << 40) == int(min(2 * GIB, available // 4) / 2 // per_block)
    with pytest.raises(KVCacheMemoryError, match=r"kv_cache_memory_gb=1e-09, 1 rank\(s\)\), one block needs"):
        LLMEngine(EngineConfig(model=str(llama_ckpt), device="cpu", dtype="float32", kv_cache_memory_gb=1e-9))
