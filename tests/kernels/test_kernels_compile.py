"""Every Triton kernel compiles to an H100/H200 binary (sm_90), even on a machine without a GPU.

The interpreter checks what the kernels compute, not that the GPU compiler accepts them (it
runs constructs the compiler rejects, and the reverse). Triton ships its NVIDIA compiler and
ptxas, so this file, run as a script without TRITON_INTERPRET, compiles each kernel for a
given architecture through the normal launch path, with a stand-in driver that only answers
which GPU to target and launches nothing. Uses Triton internals (driver.set_active,
JITFunction.run); if they move, update `_compile_only`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("arch", [90])  # one architecture: a cold compile of everything takes ~30 s here
def test_every_kernel_compiles_for_the_gpu(arch: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, __file__, str(arch)], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compiled = dict(line.split()[1:3] for line in done.stdout.splitlines() if line.startswith("compiled "))
    assert set(compiled) == {"_decode_kernel", "_merge_kernel", "_prefill_kernel", "_reshape_and_cache_kernel",
                             "_copy_blocks_kernel", "_rms_norm_kernel", "_rotary_kernel", "_act_and_mul_kernel"}
    assert all(int(size) > 0 for size in compiled.values())  # bytes of cubin


def _compile_only(arch: int) -> None:
    """Make every kernel launch compile for `arch` (e.g. 90 = sm_90) and print what it built."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class TargetOnlyDriver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

    driver.set_active(TargetOnlyDriver())
    run = JITFunction.run

    def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        print("compiled", self.fn.__name__, len(kernel.asm["cubin"]), flush=True)
        return kernel

    JITFunction.run = compile_instead_of_launch


def _launch_every_kernel() -> None:
    """Call each wrapper once per dtype and head-size class with CPU tensors (only their metadata
    matters: nothing runs)."""
    import torch
    from streamer_kernels.activation_triton import silu_and_mul
    from streamer_kernels.cache_ops_triton import copy_blocks, reshape_and_cache
    from streamer_kernels.paged_decode_triton import paged_decode_attention
    from streamer_kernels.paged_prefill_triton import paged_prefill_attention
    from streamer_kernels.rms_norm_triton import rms_norm
    from streamer_kernels.rotary_triton import rotary_embedding

    heads, kv_heads, tokens = 32, 8, 6
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_size in (64, 80, 128):
            kc = torch.empty(16, 16, kv_heads, head_size, dtype=dtype)
            vc = torch.empty_like(kc)
            tables = torch.zeros(3, 4, dtype=torch.int32)
            lens = torch.full((3,), 60, dtype=torch.int32)
            q = torch.empty(3, heads, head_size, dtype=dtype)
            for splits in (1, 2):
                paged_decode_attention(q, kc, vc, tables, lens, 0.1, 60, num_splits=splits)
            qsl = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
            paged_prefill_attention(torch.empty(tokens, heads, head_size, dtype=dtype), kc, vc, tables, qsl, lens,
                                    0.1, 2)
            if head_size == 128:  # Gemma's layers: sliding window and soft-capped scores
                paged_decode_attention(q, kc, vc, tables, lens, 0.1, 60, num_splits=2, window=32, softcap=30.0)
                paged_prefill_attention(torch.empty(tokens, heads, head_size, dtype=dtype), kc, vc, tables, qsl,
                                        lens, 0.1, 2, window=32, softcap=30.0)
            kv = torch.empty(tokens, kv_heads, head_size, dtype=dtype)
            reshape_and_cache(kv, kv, kc, vc, torch.zeros(tokens, dtype=torch.long))
            if head_size == 128:  # an fp8 (e4m3) cache, read and written with its k/v scales
                k8 = torch.empty(16, 16, kv_heads, head_size, dtype=torch.float8_e4m3fn)
                v8 = torch.empty_like(k8)
                for splits in (1, 2):
                    paged_decode_attention(q, k8, v8, tables, lens, 0.1, 60, num_splits=splits, k_scale=0.5,
                                           v_scale=0.25)
                paged_prefill_attention(torch.empty(tokens, heads, head_size, dtype=dtype), k8, v8, tables, qsl,
                                        lens, 0.1, 2, k_scale=0.5, v_scale=0.25)
                reshape_and_cache(kv, kv, k8, v8, torch.zeros(tokens, dtype=torch.long), 0.5, 0.25)
            rotary_embedding(torch.zeros(tokens, dtype=torch.long), torch.empty(tokens, heads * head_size, dtype=dtype),
                             torch.empty(tokens, kv_heads * head_size, dtype=dtype), torch.empty(8, head_size),
                             head_size)
        copy_blocks([kc], [vc], torch.tensor([[0, 1]]))
        x = torch.empty(tokens, 4096, dtype=dtype)
        rms_norm(x, torch.empty(4096, dtype=dtype), 1e-5, torch.empty_like(x))
        rms_norm(x, torch.empty(4096, dtype=dtype), 1e-5)
        silu_and_mul(torch.empty(tokens, 2 * 14336, dtype=dtype))


if __name__ == "__main__":
    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the interpreter off"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _compile_only(int(sys.argv[1]))
    _launch_every_kernel()
