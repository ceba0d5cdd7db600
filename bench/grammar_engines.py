"""Compare grammar engines (xgrammar, llguidance, outlines-core): compile and per-token mask time.

For structured outputs, on this CPU: tokenizer preparation, grammar compile time, next-token
bitmask time per token at batch 1/16/64, whether the fills release the GIL, applying the mask to
logits, and which JSON-schema keywords each library enforces.

    python -m bench.grammar_engines                 # full run (about 2-3 minutes on 2 cores)
    python -m bench.grammar_engines --quick         # smoke run (about 20 s, 4k tokenizer)
    python -m bench.grammar_engines --json out.json # also save every number

Tokenizers: the 32k byte-level BPE of `streamer.random_checkpoint.build_tokenizer` (built into a
temporary folder; few real merges, the rest added tokens) and, when it has been converted on this
machine (`streamer up` does it once), the default model's 49k tokenizer (SmolLM2). Nothing is
downloaded.

Grammars: a nested JSON schema (an order: 49 properties, objects 4 levels deep, arrays of
objects, enums, formats, patterns, optional fields), any JSON object, two regexes (ISO
date-time, email-like), a choice of 5 strings and an arithmetic-expression EBNF grammar.
Compile times use no compile cache (xgrammar's is turned off; the others have none).

Per-token mask time: valid documents are tokenized with the same tokenizer and fed one token at
a time (fill the next-token bitmask, then accept the token); every token is checked against its
mask on the first walk, and the end-of-sequence token against the last one: a library that
rejects a valid output is reported as such. At batch 16 and 64 each matcher walks its own
document and one batched bitmask is filled per step (the library's batched call where it has
one, with its default thread count). GIL: the batch-64 walk runs in a worker thread while the
main thread runs Python-driven torch work (what launching a forward pass is); reported are the
wall time against running both one after the other, and how long the main thread waits for the
GIL (about 0 when the native calls release it, about the 5 ms switch interval when they hold
it), next to two controls (a Python loop, hashlib). Mask application: each library's own
`apply_token_bitmask_inplace` on float32 CPU logits [batch, vocab], first call (includes any
torch.compile; inductor's disk cache makes later processes faster) and steady state, next to a
plain torch reference. Medians of a few repeats.

This file is the run itself; the grammars, the three libraries behind one interface, the fill walks,
the GIL probes, one library's run and the tables are in bench/parts/grammar_engines/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.parts.grammar_engines.gil import gil_controls
from bench.parts.grammar_engines.grammars import CASES, DIST_NAMES, LIBRARIES, SCHEMA, documents
from bench.parts.grammar_engines.report import cpu_model, print_tables, versions
from bench.parts.grammar_engines.runs import Settings, run_library, tokenizers
from workers.progress_display import task


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, torch.Tensor):
        return None
    return x


def check_documents() -> None:
    """The generated documents are valid instances of SCHEMA (jsonschema, when installed)."""
    try:
        import jsonschema
    except ImportError:
        return
    for d in documents("json_schema", 64, seed=7):
        jsonschema.validate(json.loads(d), SCHEMA, format_checker=jsonschema.FormatChecker())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~20 s): a 4k random tokenizer, fewer repeats, batch 16 only")
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH")
    p.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated subset")
    args = p.parse_args(argv)
    libs = [x.strip() for x in args.libraries.split(",") if x.strip()]
    unknown = [x for x in libs if x not in LIBRARIES]
    if unknown:
        p.error(f"unknown libraries {unknown}: choose from {', '.join(LIBRARIES)}")
    missing = [lib for lib in libs if importlib.util.find_spec(DIST_NAMES[lib]) is None]
    if missing:
        print(f"not installed: {', '.join(missing)} (pip install xgrammar llguidance outlines-core)", file=sys.stderr)
        libs = [x for x in libs if x not in missing]
        if not libs:
            return 1
    if args.quick:
        s = Settings(repeats=2, compile_budget_s=1.0, walk_repeats=1, batches=(16,), batch_cases=("json_schema",),
                     apply_iters=20, cases=tuple(c for c in CASES if c != "json_object"), batches_apply=(1, 16))
    else:
        s = Settings(repeats=5, compile_budget_s=3.0, walk_repeats=3, batches=(16, 64),
                     batch_cases=("json_schema",), apply_iters=50, cases=tuple(CASES),
                     batches_apply=(1, 16, 64))
    check_documents()
    started = time.perf_counter()
    report: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                              "torch_threads": torch.get_num_threads(), "versions": versions(),
                              "load_before": os.getloadavg()[0],
                              "quick": args.quick, "batches": list(s.batches), "batches_apply": list(s.batches_apply),
                              "tokenizers": {}}
    with task("GIL controls"):
        report["gil_controls"] = gil_controls(0.1 if args.quick else 0.3)
    with tempfile.TemporaryDirectory() as tmp:
        with task("building the tokenizers"):
            toks, notes = tokenizers(Path(tmp), args.quick)
        report["notes"] = notes
        for tok in toks:
            per_lib: dict[str, Any] = {"vocab_size": tok.vocab_size}
            for lib in libs:
                with task(f"{lib} on {tok.name}"):
                    per_lib[lib] = run_library(lib, tok, s, reference=lib == libs[0])
            report["tokenizers"][tok.name] = per_lib
    report["elapsed_s"] = time.perf_counter() - started
    report["load_after"] = os.getloadavg()[0]
    print_tables(report)
    print(f"\n(total {report['elapsed_s']:.0f} s; 1-minute load average {report['load_before']:.2f} before, "
          f"{report['load_after']:.2f} after, on {report['cores']} cores)")
    if args.json:
        Path(args.json).write_text(json.dumps(_json_safe(report), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
