"""Write the mixture-of-experts benchmark model (streamer.random_checkpoint.moe_bench_spec: a random
Qwen3-MoE, 8 experts, top 2) into DIR, for bench/vs_vllm.py --model DIR.

    python bench/moe_model.py DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This folder holds bench/kernels.py, named like Hugging Face's `kernels` that transformers imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from streamer.random_checkpoint import build_checkpoint, moe_bench_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build_checkpoint(args.dir, moe_bench_spec(), seed=args.seed))


if __name__ == "__main__":
    main()
