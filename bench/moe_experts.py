"""One mixture-of-experts layer's experts on the CPU, from the router's choices to each token's
weighted sum, three ways on the same inputs: the fused kernel over packed weights
(`streamer_kernels.grouped_gemm.moe_layer`: the sort by expert, gate/up, SiLU-mul, down and the
weighted sum in one call, what the engine runs on the CPU), the unfused path it replaced (torch's
sort, one grouped product per projection, `grouped_mm`, the compiled SiLU-mul between them, the
weighting and `index_add_`), and the same with the reference's loop over experts (`grouped_mm_ref`).

    python -m bench.moe_experts [--tokens 1 16 256 1024] [--experts 8] [--top-k 2] [--hidden 1024]
                                [--inter 768] [--dtype float32|bfloat16] [--iters 20] [--threads N]

Prints the median milliseconds of the layer's experts for each token count; the three run
interleaved, one call each in turn, so that a neighbour's load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from streamer_kernels.elementwise_cpu import silu_and_mul_cpu
from streamer_kernels.grouped_gemm import (
    grouped_mm,
    grouped_mm_ref,
    moe_experts_packable,
    moe_layer,
    pack_experts,
    sort_by_expert,
)


def median_ms(fns: list, iters: int) -> list[float]:  # noqa: ANN001
    """Each function's median milliseconds, the functions called in turn."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, generator=gen).to(dtype)
    w2 = torch.randn(args.experts, args.hidden, args.inter, generator=gen).to(dtype)
    print(f"{args.experts} experts, top {args.top_k}, hidden {args.hidden}, intermediate {args.inter}, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    packed = pack_experts(w13, w2) if moe_experts_packable(dtype, w13.device) else None
    if packed is None:
        print("(no fused kernel for this dtype here: its column is blank)")
    print("tokens  fused_ms  grouped_ms  loop_ms  grouped/fused")
    for tokens in args.tokens:
        chosen = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, args.top_k, generator=gen)
        x = torch.randn(tokens, args.hidden, generator=gen).to(dtype)

        def unfused(mm, x=x, chosen=chosen, weights=weights):  # noqa: ANN001, ANN202
            def run() -> torch.Tensor:  # streamer/layers/moe.py's Experts.forward, unpacked
                order, rows, offs = sort_by_expert(chosen, args.experts)
                y = mm(silu_and_mul_cpu(mm(x[rows], w13.transpose(1, 2), offs)), w2.transpose(1, 2), offs)
                return torch.zeros_like(x).index_add_(0, rows, (y * weights.flatten()[order, None]).to(dtype))
            return run

        fns = [unfused(grouped_mm), unfused(grouped_mm_ref)]
        if packed is not None:
            fns.append(lambda x=x, chosen=chosen, weights=weights: moe_layer(x, weights, chosen, packed))
        with torch.inference_mode():  # as the engine runs
            grouped, loop, *fused = median_ms(fns, args.iters)
        if fused:
            print(f"{tokens:6d}  {fused[0]:8.3f}  {grouped:10.3f}  {loop:7.3f}  {grouped / fused[0]:13.2f}")
        else:
            print(f"{tokens:6d}  {'':8}  {grouped:10.3f}  {loop:7.3f}")

if __name__ == "__main__":
    main()
