"""How many KV-cache blocks fit: pure arithmetic on measured numbers (issue 39, part 3).

The model runner measures (streamer/memory_probe.py) and this module decides, so the decision is
tested on any machine with any numbers, and the numbers come from the real run.

On CUDA, as vLLM does: after the weights are loaded, a profiling forward at the full token budget
measures the activation peak; the cache gets what is free, less the share of the whole device that
`gpu_memory_utilization` keeps back, less that peak and the CUDA graphs' reserve. On the CPU the
cache is `kv_cache_memory_gb`, else a quarter of the available RAM up to 2 GiB, split between the
tensor-parallel ranks (they share one machine's memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamer.errors import ConfigError

GIB = 1 << 30
CPU_DEFAULT_CAP = 2 * GIB  # the CPU default's ceiling: a cache past it only helps huge batches
CPU_DEFAULT_SHARE = 4  # the CPU default takes 1/4 of the available RAM: the rest is the OS's and others'


class KVCacheMemoryError(ConfigError, MemoryError):
    """Not even one KV block fits; the message is one line that names the numbers."""


@dataclass(frozen=True)
class GpuMemory:
    """What was measured on the device, in bytes."""

    free: int  # free on the device after loading the weights (and after the profiling forward let go)
    total: int  # the device's memory
    forward_peak: int  # the profiling forward's peak above what was allocated before it
    graph_reserve: int = 0  # CUDA graphs' memory pools (0: eager)


def bytes_per_block(block_size: int, num_kv_heads: int, head_size: int, num_layers: int, element_size: int) -> int:
    """One block's K and V in every layer: an fp8 cache (element_size 1) is half of bfloat16's."""
    return 2 * block_size * num_kv_heads * head_size * num_layers * element_size


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def gpu_kv_blocks(mem: GpuMemory, utilization: float, bytes_per_block: int, max_useful: int,
                  max_num_batched_tokens: int) -> int:
    """Blocks of `bytes_per_block` that fit; at most `max_useful` (every sequence at full length)."""
    kept_back = (1 - utilization) * mem.total
    budget = mem.free - kept_back - mem.forward_peak - mem.graph_reserve
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise KVCacheMemoryError(
            f"no GPU memory left for the KV cache: {_gib(mem.free)} free of {_gib(mem.total)} after loading the "
            f"model, {_gib(kept_back)} kept back (gpu_memory_utilization {utilization}), {_gib(mem.forward_peak)} "
            f"for activations (a forward of max_num_batched_tokens={max_num_batched_tokens}), "
            f"{_gib(mem.graph_reserve)} for CUDA graphs, one block needs {bytes_per_block} bytes: raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens or use a smaller model or more GPUs")
    return min(blocks, max_useful)


def cpu_kv_blocks(cache_bytes: float | None, available: int, tp_size: int, bytes_per_block: int,
                  max_useful: int) -> int:
    """Blocks of the CPU cache: `cache_bytes` (kv_cache_memory_gb) or the default share of `available`
    RAM, split over `tp_size` ranks; at most `max_useful`."""
    budget = cache_bytes if cache_bytes else min(CPU_DEFAULT_CAP, available // CPU_DEFAULT_SHARE)
    per_rank = budget / tp_size
    blocks = int(per_rank // bytes_per_block)
    if blocks < 1:
        source = (f"kv_cache_memory_gb={cache_bytes / GIB:g}" if cache_bytes else
                  f"1/{CPU_DEFAULT_SHARE} of {_gib(available)} available RAM")
        raise KVCacheMemoryError(
            f"no memory for one KV block: {_gib(per_rank)} per rank ({source}, {tp_size} rank(s)), one block "
            f"needs {bytes_per_block} bytes: raise kv_cache_memory_gb or pass num_kv_blocks")
    return min(blocks, max_useful)
