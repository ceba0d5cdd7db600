"""The compiled CPU kernels (kernels/csrc/) against their torch references, side by side.

    python -m bench.cpu_kernels [--dtype float32,bfloat16] [--iters 20]

Shapes of the speed anchors' model (12 query / 4 KV heads, head size 64, hidden 768, MLP 2048,
16-token blocks). Decode attention reads sequences whose blocks are scattered over a cache larger
than the last-level cache, as a long-running server's are; its GB/s counts the K/V bytes it must
read at the least. Each figure is the median of `--iters` timed calls after 3 untimed ones; the
ratio is reference time over kernel time, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from streamer_kernels.activation import silu_and_mul_ref
from streamer_kernels.cache_ops import reshape_and_cache_ref
from streamer_kernels.cpu_attention import paged_decode_attention_cpu, paged_prefill_attention_cpu, prefill_products
from streamer_kernels.elementwise_cpu import reshape_and_cache_cpu, rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu
from streamer_kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref
from streamer_kernels.rms_norm import rms_norm_ref
from streamer_kernels.rotary import rotary_embedding_ref

HEADS, KV_HEADS, HEAD, HIDDEN, MLP, BLOCK = 12, 4, 64, 768, 2048, 16


def timed(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of one call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_cases(dtype: torch.dtype) -> list[tuple[str, Callable, Callable, int]]:
    cases = []
    for batch, ctx in [(1, 400), (32, 200), (64, 400), (8, 2000)]:
        blocks = -(-ctx // BLOCK)
        num_blocks = batch * blocks + 8
        k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD).to(dtype)
        v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD).to(dtype)
        tables = torch.randperm(num_blocks)[: batch * blocks].view(batch, blocks).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch, HEADS, HEAD).to(dtype)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD * k.element_size()
        cases.append(attention_case(f"decode attention {batch}x{ctx}", q, k, v, tables, lens, kv_bytes))
    cases.append(shared_prefix_case(dtype))
    return cases


def attention_case(label: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                   lens: torch.Tensor, kv_bytes: int) -> tuple[str, Callable, Callable, int]:
    return (label, lambda: paged_decode_attention_cpu(q, k, v, tables, lens, 0.125),
            lambda: paged_decode_attention_ref(q, k, v, tables, lens, 0.125), kv_bytes)


def shared_prefix_case(dtype: torch.dtype, batch: int = 32, prefix: int = 208) -> tuple[str, Callable, Callable, int]:
    """The anchors' `chat` decodes: 32 sequences whose first 13 blocks are the same physical
    blocks (a prefix-cache hit), then 8-96 positions of their own. GB/s counts the shared blocks
    once, as the kernel reads them."""
    gen = torch.Generator().manual_seed(0)
    own = torch.randint(8, 97, (batch,), generator=gen)
    shared_blocks, own_blocks = prefix // BLOCK, [-(-int(n) // BLOCK) for n in own]
    num_blocks = shared_blocks + sum(own_blocks) + 8
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD).to(dtype)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros(batch, shared_blocks + max(own_blocks), dtype=torch.int32)
    taken = shared_blocks
    for b, n in enumerate(own_blocks):
        tables[b, :shared_blocks] = order[:shared_blocks]
        tables[b, shared_blocks:shared_blocks + n] = order[taken:taken + n]
        taken += n
    lens = (prefix + own).int()
    q = torch.randn(batch, HEADS, HEAD).to(dtype)
    kv_bytes = 2 * (prefix + int(own.sum())) * KV_HEADS * HEAD * k.element_size()
    return attention_case(f"decode attention {batch}x({prefix} shared + own)", q, k, v, tables, lens, kv_bytes)


def prefill_cases(dtype: torch.dtype) -> list[tuple[str, Callable, Callable, int]]:
    """One prompt of the `prefill` workload's size, and a chunk extending 1,000 cached positions."""
    cases = []
    for context, new in [(0, 1500), (1000, 900)]:
        length = context + new
        blocks = -(-length // BLOCK)
        k = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD).to(dtype)
        v = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD).to(dtype)
        tables = torch.randperm(blocks + 4)[:blocks].view(1, blocks).int()
        q = torch.randn(new, HEADS, HEAD).to(dtype)
        starts, lens = torch.tensor([0, new], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
        for products in prefill_products(dtype):  # every product path this CPU runs
            cases.append((f"prefill attention {context}+{new} ({products})",
                          lambda q=q, k=k, v=v, t=tables, s=starts, n=lens, p=products: paged_prefill_attention_cpu(
                              q, k, v, t, s, n, 0.125, products=p),
                          lambda q=q, k=k, v=v, t=tables, s=starts, n=lens: paged_prefill_attention_ref(
                              q, k, v, t, s, n, 0.125), 0))
    return cases


def elementwise_cases(dtype: torch.dtype) -> list[tuple[str, Callable, Callable, int]]:
    cases = []
    for tokens in (64, 2048):
        x = torch.randn(tokens, HIDDEN).to(dtype)
        res = torch.randn(tokens, HIDDEN).to(dtype)
        w = torch.randn(HIDDEN).to(dtype)
        gate_up = torch.randn(tokens, 2 * MLP).to(dtype)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD).to(dtype)
        q, k, val = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], -1)
        cos_sin = torch.randn(4096, HEAD)
        pos = torch.randint(0, 4096, (tokens,))
        caches = [torch.randn(tokens // BLOCK + 4, BLOCK, KV_HEADS, HEAD).to(dtype) for _ in range(2)]
        slots = torch.randperm(caches[0].shape[0] * BLOCK)[:tokens]
        k3, v3 = k.view(tokens, KV_HEADS, HEAD), val.view(tokens, KV_HEADS, HEAD)
        cases += [
            (f"residual + RMSNorm x{tokens}", lambda x=x, r=res, w=w: rms_norm_cpu(x, w, 1e-5, r),
             lambda x=x, r=res, w=w: rms_norm_ref(x, w, 1e-5, r), 0),
            (f"rotary x{tokens}", lambda q=q, k=k, c=cos_sin, p=pos: rotary_embedding_cpu(p, q, k, c, HEAD),
             lambda q=q, k=k, c=cos_sin, p=pos: rotary_embedding_ref(p, q, k, c, HEAD), 0),
            (f"SiLU-and-mul x{tokens}", lambda g=gate_up: silu_and_mul_cpu(g),
             lambda g=gate_up: silu_and_mul_ref(g), 0),
            (f"cache write x{tokens}", lambda k=k3, v=v3, c=caches, s=slots: reshape_and_cache_cpu(k, v, *c, s),
             lambda k=k3, v=v3, c=caches, s=slots: reshape_and_cache_ref(k, v, *c, s), 0),
        ]
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | op | kernel ms | reference ms | ratio | kernel GB/s |")
    print("|---|---|---|---|---|---|")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        for label, kernel, ref, nbytes in decode_cases(dtype) + prefill_cases(dtype) + elementwise_cases(dtype):
            ours, theirs = timed(kernel, args.iters), timed(ref, args.iters)
            gbs = f"{nbytes / ours / 1e6:.1f}" if nbytes else "-"
            print(f"| {name} | {label} | {ours:.3f} | {theirs:.3f} | **{theirs / ours:.1f}x** | {gbs} |", flush=True)


if __name__ == "__main__":
    main()
