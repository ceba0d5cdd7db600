"""Write the mixture-of-experts benchmark model (streamer.random_checkpoint.moe_bench_spec: a random
Qwen3-MoE, 8 experts, top 2) into DIR, for bench/vs_vllm.py --model DIR.

    python -m bench.moe_model DIR [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from streamer.random_checkpoint import build_checkpoint, moe_bench_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build_checkpoint(args.dir, moe_bench_spec(), seed=args.seed))


if __name__ == "__main__":
    main()
