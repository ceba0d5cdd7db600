"""`streamer bench NAME [ARGS...]`: run bench/NAME.py (`python -m bench.NAME`) from the source checkout.

The benchmarks are scripts, not part of the installed package; everything after NAME is passed
to the script unchanged (`streamer bench throughput --help` shows the script's own options).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

from workers.errors import UserError


def bench_dir() -> Path:
    """bench/ of the source checkout this package runs from, else ./bench (the image copies it to
    its working directory, beside an installed package)."""
    checkout = Path(__file__).resolve().parents[2] / "bench"
    return checkout if checkout.is_dir() else Path.cwd() / "bench"


BENCH_DIR = bench_dir()


def scripts(folder: Path = BENCH_DIR) -> dict[str, Path]:
    """Benchmark name -> script: every bench/*.py meant to be run (it has a `__main__` block);
    the others are helper modules shared by the scripts."""
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.glob("*.py"))
            if not p.name.startswith("_") and "__main__" in p.read_text(errors="replace")}


def describe(script: Path, width: int = 100) -> str:
    """One line about a benchmark: the first sentence of its docstring."""
    doc = ast.get_docstring(ast.parse(script.read_text(errors="replace"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[\w)])\. (?=[A-Z])", paragraph)[0]
    if sentence.endswith(".") and not sentence.endswith("..."):
        sentence = sentence[:-1]
    return sentence if len(sentence) <= width else sentence[:width - 1].rstrip() + "…"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    found = ", ".join(scripts()) or "none found"
    parser.add_argument("name", nargs="?", help=f"benchmark to run ({found}); omit to list them")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the benchmark script unchanged")


def run(args: argparse.Namespace) -> int:
    available = scripts()
    if not args.name:
        if not available:
            print(f"no benchmarks found in {BENCH_DIR}")
        for name, path in available.items():
            print(f"{name:14s} {describe(path)}")
        if available:
            print(f"\nrun one: streamer bench NAME [ARGS]; its options: streamer bench NAME --help ({BENCH_DIR})")
        return 0
    if not BENCH_DIR.is_dir():
        raise UserError("benchmarks run from a source checkout or beside one's bench/ folder (it is not "
                        "installed): clone the repository and run `pip install -e .` there")
    script = available.get(args.name)
    if script is None:
        raise UserError(f"no benchmark named {args.name!r}: choose one of {', '.join(available) or '(none)'}")
    # A child process keeps the script's own argv, exit status and Ctrl-C behaviour intact. Run as a
    # module from the folder holding bench/, so that it imports bench.harness and its parts.
    return subprocess.call([sys.executable, "-m", f"bench.{script.stem}", *args.script_args], cwd=BENCH_DIR.parent)
