"""Kernel benchmark: each Triton kernel vs its torch reference (and attention vs SDPA on gathered K/V).

    python -m bench.kernel_speed [--dtype bfloat16] [--iters 50]   # on a CUDA GPU
    python -m bench.kernel_speed --smoke                           # CPU: runs every path once, tiny shapes

Times with CUDA events (median of `--iters` runs after warm-up, L2 flushed before each run),
counts the bytes each kernel must move at least, and prints the achieved GB/s against a
measured device-to-device copy bandwidth. Without a GPU it says so and exits 0; `--smoke`
runs everything under the Triton interpreter with wall-clock timing, to check the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Case:
    kernel: str
    shape: str
    bytes: int  # the least a kernel must read + write
    impls: dict[str, Callable[[], object]]  # first entry: the Triton kernel
    flops: int = 0
    check: Callable[[], float] | None = None  # relative error of the Triton output vs the reference


def _rel(a, b) -> float:  # noqa: ANN001
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@dataclass
class _Attn:
    """Shapes and tensors shared by the attention cases."""

    torch: Any
    dev: Any
    dtype: Any
    heads: int
    kv_heads: int
    head_size: int
    block_size: int

    @property
    def scale(self) -> float:
        return self.head_size ** -0.5

    def paged(self, batch: int, ctx: int) -> tuple[Any, Any, Any, Any]:
        """Random K/V caches, shuffled block tables and lengths for `batch` sequences of `ctx` tokens."""
        torch, dev = self.torch, self.dev
        nblk = -(-ctx // self.block_size)
        shape = (batch * nblk, self.block_size, self.kv_heads, self.head_size)
        kc, vc = torch.randn(shape, device=dev, dtype=self.dtype), torch.randn(shape, device=dev, dtype=self.dtype)
        tables = torch.randperm(batch * nblk, device=dev).view(batch, nblk).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        return kc, vc, tables, lens


def attention_cases(torch, dev, dtype, smoke: bool) -> list[Case]:  # noqa: ANN001
    a = _Attn(torch, dev, dtype, *((8, 2, 64, 16) if smoke else (32, 8, 128, 16)))
    decode_shapes = [(2, 100), (1, 1100)] if smoke else [(64, 1024), (32, 4096), (8, 8192), (1, 32768), (4, 32768)]
    prefill_shapes = [(2, 40, 0)] if smoke else [(4, 1024, 0), (4, 256, 3840)]
    return [_decode_case(a, b, ctx) for b, ctx in decode_shapes] + \
        [_prefill_case(a, b, q_len, ctx) for b, q_len, ctx in prefill_shapes]


def _decode_case(a: _Attn, batch: int, ctx: int) -> Case:
    from streamer_kernels.paged_attention import gather_kv, paged_decode_attention_ref
    from streamer_kernels.paged_decode_triton import decode_num_splits, paged_decode_attention

    torch, dev, scale, f = a.torch, a.dev, a.scale, a.torch.nn.functional
    kc, vc, tables, lens = a.paged(batch, ctx)
    q = torch.randn(batch, a.heads, a.head_size, device=dev, dtype=a.dtype)
    out = torch.empty_like(q)
    k = gather_kv(kc, tables, ctx).transpose(1, 2).contiguous()  # [B, KVH, L, D], for SDPA alone
    v = gather_kv(vc, tables, ctx).transpose(1, 2).contiguous()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    splits = decode_num_splits(batch, a.kv_heads, ctx, sms)
    return Case(
        "paged_decode", f"B={batch} L={ctx} splits={splits}",
        bytes=kc.element_size() * (2 * batch * ctx * a.kv_heads * a.head_size + 2 * q.numel()) + tables.numel() * 4,
        flops=4 * batch * a.heads * ctx * a.head_size,
        impls={
            "triton": lambda: paged_decode_attention(q, kc, vc, tables, lens, scale, ctx, out=out),
            "torch ref": lambda: paged_decode_attention_ref(q, kc, vc, tables, lens, scale, ctx),
            "sdpa (gathered)": lambda: f.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                                                      enable_gqa=True),
        },
        check=lambda: _rel(paged_decode_attention(q, kc, vc, tables, lens, scale, ctx),
                           paged_decode_attention_ref(q, kc, vc, tables, lens, scale, ctx)))


def _prefill_case(a: _Attn, batch: int, q_len: int, ctx: int) -> Case:
    from streamer_kernels.paged_attention import gather_kv, paged_prefill_attention_ref
    from streamer_kernels.paged_prefill_triton import paged_prefill_attention

    torch, dev, scale, f = a.torch, a.dev, a.scale, a.torch.nn.functional
    total = q_len + ctx
    kc, vc, tables, lens = a.paged(batch, total)
    q = torch.randn(batch * q_len, a.heads, a.head_size, device=dev, dtype=a.dtype)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    k = gather_kv(kc, tables, total).transpose(1, 2).contiguous()
    v = gather_kv(vc, tables, total).transpose(1, 2).contiguous()
    qd = q.view(batch, q_len, a.heads, a.head_size).transpose(1, 2)
    mask = torch.ones(q_len, total, dtype=torch.bool, device=dev).tril(ctx)
    pairs = batch * (q_len * ctx + q_len * (q_len + 1) // 2)  # (query, key) pairs attended
    return Case(
        "paged_prefill", f"B={batch} new={q_len} ctx={ctx}",
        bytes=kc.element_size() * (2 * batch * total * a.kv_heads * a.head_size + 2 * q.numel()),
        flops=4 * pairs * a.heads * a.head_size,
        impls={
            "triton": lambda: paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale, q_len, out=out),
            "torch ref": lambda: paged_prefill_attention_ref(q, kc, vc, tables, qsl, lens, scale),
            "sdpa (gathered)": lambda: f.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale,
                                                                      enable_gqa=True),
        },
        check=lambda: _rel(paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale),
                           paged_prefill_attention_ref(q, kc, vc, tables, qsl, lens, scale)))


def elementwise_cases(torch, dev, dtype, smoke: bool) -> list[Case]:  # noqa: ANN001
    from streamer_kernels.activation import silu_and_mul_ref
    from streamer_kernels.activation_triton import silu_and_mul
    from streamer_kernels.cache_ops import copy_blocks_ref, reshape_and_cache_ref
    from streamer_kernels.cache_ops_triton import copy_blocks, reshape_and_cache
    from streamer_kernels.rms_norm import rms_norm_ref
    from streamer_kernels.rms_norm_triton import rms_norm
    from streamer_kernels.rotary import rotary_embedding_ref
    from streamer_kernels.rotary_triton import rotary_embedding

    tokens, hidden, inter = (16, 96, 160) if smoke else (4096, 4096, 14336)
    heads, kv_heads, head_size, block_size = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    layers, pairs = (2, 3) if smoke else (32, 256)
    size = torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape: int):  # noqa: ANN202
        return torch.randn(*shape, device=dev, dtype=dtype)

    x, res, w = rnd(tokens, hidden), rnd(tokens, hidden), rnd(hidden)
    gate_up = rnd(tokens, 2 * inter)
    qkv = rnd(tokens, (heads + 2 * kv_heads) * head_size)
    q, k = qkv[:, :heads * head_size], qkv[:, heads * head_size:(heads + kv_heads) * head_size]
    kv = qkv[:, heads * head_size:].view(tokens, 2, kv_heads, head_size)
    positions = torch.randint(0, 8192, (tokens,), device=dev)
    cos_sin = torch.randn(8192, head_size, device=dev)
    num_blocks = -(-tokens // block_size) + 2 * pairs
    kc, vc = rnd(num_blocks, block_size, kv_heads, head_size), rnd(num_blocks, block_size, kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:tokens]
    caches = [rnd(2 * pairs, block_size, kv_heads, head_size) for _ in range(2 * layers)]
    mapping = torch.stack((torch.arange(pairs), torch.arange(pairs, 2 * pairs)), dim=1).to(dev)
    kv_bytes = tokens * kv_heads * head_size * size
    return [
        Case("rms_norm+residual", f"T={tokens} H={hidden}", bytes=size * (5 * tokens * hidden + hidden),
             impls={"triton": lambda: rms_norm(x, w, 1e-5, res), "torch ref": lambda: rms_norm_ref(x, w, 1e-5, res)},
             check=lambda: _rel(rms_norm(x, w, 1e-5, res)[0], rms_norm_ref(x, w, 1e-5, res)[0])),
        Case("silu_and_mul", f"T={tokens} I={inter}", bytes=size * 3 * tokens * inter,
             impls={"triton": lambda: silu_and_mul(gate_up), "torch ref": lambda: silu_and_mul_ref(gate_up)},
             check=lambda: _rel(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))),
        Case("rotary (in place)", f"T={tokens} H={heads}/{kv_heads} D={head_size}",
             bytes=2 * size * tokens * (heads + kv_heads) * head_size + 4 * tokens * head_size,
             impls={"triton": lambda: rotary_embedding(positions, q, k, cos_sin, head_size),
                    "torch ref": lambda: rotary_embedding_ref(positions, q, k, cos_sin, head_size)}),
        Case("reshape_and_cache", f"T={tokens} KVH={kv_heads} D={head_size}", bytes=4 * kv_bytes,
             impls={"triton": lambda: reshape_and_cache(kv[:, 0], kv[:, 1], kc, vc, slots),
                    "torch ref": lambda: reshape_and_cache_ref(kv[:, 0], kv[:, 1], kc, vc, slots)}),
        Case("copy_blocks", f"layers={layers} pairs={pairs}",
             bytes=2 * len(caches) * pairs * caches[0][0].numel() * size,
             impls={"triton": lambda: copy_blocks(caches[:layers], caches[layers:], mapping),
                    "torch ref": lambda: copy_blocks_ref(caches[:layers], caches[layers:], mapping)}),
    ]


class Timer:
    """Median seconds per call: CUDA events with L2 flushed between runs, or wall clock (smoke)."""

    def __init__(self, torch, dev, warmup: int, iters: int) -> None:  # noqa: ANN001
        self.torch, self.dev, self.warmup, self.iters = torch, dev, warmup, iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None

    def __call__(self, fn: Callable[[], object]) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.flush is None:
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
                continue
            self.flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(times)


def copy_bandwidth(torch, dev, timer: Timer, smoke: bool) -> float:  # noqa: ANN001
    """Bytes/s of a device-to-device copy (read + write counted), the roofline for these kernels."""
    n = (16 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * n / timer(lambda: dst.copy_(src))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU: Triton interpreter, tiny shapes, 2 runs each")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines any kernel
    import torch

    from workers.progress_display import task

    if not args.smoke and not torch.cuda.is_available():
        print("bench/kernel_speed.py: no CUDA device here, nothing to time (skipped). "
              "Run it on a GPU, or with --smoke to check the script under the Triton interpreter.")
        return 0
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    timer = Timer(torch, dev, *((1, 2) if args.smoke else (args.warmup, args.iters)))
    name = "CPU, Triton interpreter (smoke run: the numbers mean nothing)" if args.smoke else \
        torch.cuda.get_device_name(dev)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(torch, dev, timer, args.smoke)
    cases = attention_cases(torch, dev, dtype, args.smoke) + elementwise_cases(torch, dev, dtype, args.smoke)
    rows = []
    with task("kernel timings", total=sum(len(case.impls) for case in cases)) as bar:
        for case in cases:
            try:
                err = f"{case.check():.1e}" if case.check else ""
            except Exception as e:  # one broken kernel must not hide the others' numbers
                err = f"FAILED: {type(e).__name__}: {e}"[:60]
            for impl, fn in case.impls.items():
                row = [case.kernel, case.shape, impl]
                bar.update(description=f"kernel timings ({case.kernel} {case.shape}: {impl})")
                try:
                    secs = timer(fn)
                except Exception as e:
                    rows.append([*row, f"FAILED: {type(e).__name__}: {e}"[:60], "", "", "", ""])
                    print(f"{case.kernel:18} {case.shape:28} {impl:16} failed: {e}", flush=True)
                    continue
                finally:
                    bar.advance()
                gbs = case.bytes / secs / 1e9
                rows.append([*row, f"{secs * 1e6:.1f}", f"{gbs:.0f}", f"{100 * gbs * 1e9 / copy_bw:.0f}%",
                             f"{case.flops / secs / 1e12:.1f}" if case.flops else "", err if impl == "triton" else ""])
                print(f"{case.kernel:18} {case.shape:28} {impl:16} {secs * 1e6:10.1f} us", flush=True)
        bar.update(description="kernel timings")
    header = ["kernel", "shape", "impl", "us", "GB/s", "of copy", "TFLOP/s", "rel err"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{name}, {args.dtype}; device-to-device copy: {copy_bw / 1e9:.0f} GB/s; median of {timer.iters} runs")
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
