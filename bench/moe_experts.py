"""One mixture-of-experts layer's experts on the CPU: torch's grouped product (one call per
projection, `streamer_kernels.grouped_gemm.grouped_mm`) against the reference, a loop over
experts (`grouped_mm_ref`), on the same sorted rows.

    python -m bench.moe_experts [--tokens 1 16 256 1024] [--experts 8] [--top-k 2] [--hidden 1024]
                                [--inter 768] [--dtype float32] [--iters 20] [--threads N]

Prints the median milliseconds of both projections of the layer for each token count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from streamer_kernels.grouped_gemm import grouped_mm, grouped_mm_ref


def median_ms(fn, iters: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


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
    print("tokens  grouped_ms  loop_ms  loop/grouped")
    for tokens in args.tokens:
        chosen = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(tokens)])
        counts = torch.bincount(chosen.flatten(), minlength=args.experts)
        offs = counts.cumsum(0).to(torch.int32)
        x = torch.randn(tokens * args.top_k, args.hidden, generator=gen).to(dtype)
        h = torch.randn(tokens * args.top_k, args.inter, generator=gen).to(dtype)

        def run(mm, x=x, h=h, offs=offs):  # noqa: ANN001, ANN202
            return lambda: (mm(x, w13.transpose(1, 2), offs), mm(h, w2.transpose(1, 2), offs))

        grouped, loop = median_ms(run(grouped_mm), args.iters), median_ms(run(grouped_mm_ref), args.iters)
        print(f"{tokens:6d}  {grouped:10.3f}  {loop:7.3f}  {loop / grouped:11.2f}")


if __name__ == "__main__":
    main()
