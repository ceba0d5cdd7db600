"""The grammar-engine benchmark's tables (bench/grammar_engines.py)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

from bench.parts.grammar_engines.grammars import CASES, DIST_NAMES, LIBRARIES
from bench.parts.grammar_engines.libraries import ENGINES_API
from bench.parts.grammar_engines.runs import FEATURES, REFERENCE_APPLY

# ---- output ---------------------------------------------------------------------------------

def cpu_model() -> str:
    model, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line
    return model + (" with AVX-512" if " avx512f" in flags else " with AVX2" if " avx2" in flags else "")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in (*DIST_NAMES.values(), "torch", "transformers", "tokenizers", "jsonschema"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _f(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if x < 10_000 else f"{x:,.0f}"


def print_tables(report: dict) -> None:
    print(f"\nCPU: {report['cpu']} ({report['cores']} cores), Python {report['python']}, torch threads "
          f"{report['torch_threads']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    for note in report["notes"]:
        print(f"note: {note}")
    shown: dict | None = None
    for tname, per_lib in report["tokenizers"].items():
        print(f"\n## {tname} (vocab {per_lib['vocab_size']})\n")
        matrix = {lib: per_lib[lib]["features"] for lib in LIBRARIES if "features" in per_lib.get(lib, {})}
        if matrix and matrix == shown:
            print("JSON-schema keywords: as with the tokenizer above\n")
        elif matrix:
            shown = matrix
            print("JSON-schema keywords (each as the value of a property of a closed object; enforced = a "
                  "valid instance passes and one breaking only that keyword is refused; ignored = both pass)\n")
            print("| keyword | " + " | ".join(matrix) + " |")
            print("|---|" + "---|" * len(matrix))
            for kw in FEATURES:
                print(f"| {kw} | " + " | ".join(matrix[lib][kw] for lib in matrix) + " |")
            print()
        print("tokenizer preparation: " + ", ".join(
            f"{lib} {per_lib[lib]['prepare_s'] * 1e3:,.0f} ms" for lib in LIBRARIES if lib in per_lib))
        print("\n| grammar | library | compile ms | first mask ms | mask µs/token b1 mean | p99 | accept µs |"
              " cold walk mean µs | new matcher µs | fork µs | replay half ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for case, label in CASES.items():
            for lib in LIBRARIES:
                if lib not in per_lib or case not in per_lib[lib]["cases"]:
                    continue
                r = per_lib[lib]["cases"][case]
                if not r.get("supported"):
                    why = r.get("error", "not supported")
                    print(f"| {label} | {lib} | {why} | | | | | | | | |")
                    continue
                if "walk_error" in r:
                    print(f"| {label} | {lib} | {_f(r['compile_ms'])} | {_f(r['first_mask_ms'], 2)} | "
                          f"{r['walk_error']} | | | | | | |")
                    continue
                b1 = r["b1"]
                print(f"| {label} | {lib} | {_f(r['compile_ms'])} | {_f(r['first_mask_ms'], 2)} | "
                      f"{_f(b1['mask_mean_us'])} | {_f(b1['mask_p99_us'])} | {_f(b1['accept_mean_us'])} | "
                      f"{_f(r['cold_walk_mask_mean_us'])} | {_f(r['new_matcher_us'])} | {_f(r['fork_us'])} | "
                      f"{_f(r['replay_half_ms'], 2)} |")
        counts = {CASES[c]: r["b1"]["tokens"] for lib in LIBRARIES
                  for c, r in per_lib.get(lib, {}).get("cases", {}).items() if "b1" in r}
        print("\ntokens walked at batch 1: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        batch_cases = [c for c in CASES if any(f"b{report['batches'][-1]}" in per_lib[lib]["cases"].get(c, {})
                                               for lib in LIBRARIES if lib in per_lib)]
        for case in batch_cases:
            print(f"\nbatched mask fill, {CASES[case]} (each row its own document; µs per token = step / rows)\n")
            print("| library | batch | call | mask µs/token mean | p99 | step ms mean | step p99 | accept µs/token |")
            print("|---|---|---|---|---|---|---|---|")
            for lib in LIBRARIES:
                r = per_lib.get(lib, {}).get("cases", {}).get(case, {})
                api = ENGINES_API.get(lib) or "loop of single fills"
                for key in (f"b{b}" for b in report["batches"]):
                    if key in r:
                        x = r[key]
                        print(f"| {lib} | {key[1:]} | {api} | {_f(x['mask_mean_us'])} | {_f(x['mask_p99_us'])} | "
                              f"{_f(x['step_mean_ms'], 2)} | {_f(x['step_p99_ms'], 2)} | {_f(x['accept_mean_us'])} |")
                loop = r.get(f"b{report['batches'][-1]}_loop")
                if loop:
                    print(f"| {lib} | {report['batches'][-1]} | loop of single fills | {_f(loop['mask_mean_us'])} | "
                          f"{_f(loop['mask_p99_us'])} | {_f(loop['step_mean_ms'], 2)} | {_f(loop['step_p99_ms'], 2)} |"
                          f" {_f(loop['accept_mean_us'])} |")
            print(f"\nthe batch-{report['batches'][-1]} walk in a worker thread while the main thread runs a "
                  "Python-driven torch loop as long (1 torch thread). ratio = together / one after the other "
                  "(~0.5: they overlap); GIL wait = median ms the main thread waits for the GIL after a short "
                  "sleep (~0: released in native calls; ~5, the switch interval: held)\n")
            print("| work in the thread | one after the other ms | together ms | ratio | GIL wait ms | GIL |")
            print("|---|---|---|---|---|---|")
            for name, o in report["gil_controls"].items():
                print(f"| control: {name.split(' ', 1)[1].strip('()')} | {_f(o['serial_ms'])} | "
                      f"{_f(o['threaded_ms'])} | {o['ratio']:.2f} | {o['gil_wait_ms']:.2f} | {name.split(' ')[0]} |")
            for lib in LIBRARIES:
                r = per_lib.get(lib, {}).get("cases", {}).get(case, {})
                for key, api in (("overlap", "loop of single fills"), ("overlap_batched", ENGINES_API.get(lib))):
                    if key in r:
                        o = r[key]
                        gil = "released" if o["gil_wait_ms"] < 1.0 else "held"
                        print(f"| {lib}: {api} | {_f(o['serial_ms'])} | {_f(o['threaded_ms'])} | "
                              f"{o['ratio']:.2f} | {o['gil_wait_ms']:.2f} | {gil} |")
        rows = [(name, a) for lib in LIBRARIES for name, a in per_lib.get(lib, {}).get("apply", {}).items()]
        if rows:
            bs = report["batches_apply"]
            allowed = next(per_lib[lib]["apply_allowed_per_row"] for lib in LIBRARIES
                           if "apply_allowed_per_row" in per_lib.get(lib, {}))
            print(f"\napplying the mask to float32 logits [batch, {per_lib['vocab_size']}] (µs, steady state; "
                  f"first call in ms, includes any torch.compile; masks from the walk, {allowed:,.0f} tokens "
                  "allowed per row on average)\n")
            print("| function | " + " | ".join(f"batch {b}" for b in bs) + " | " +
                  " | ".join(f"first call b{b} ms" for b in bs) + " |")
            print("|---|" + "---|" * (2 * len(bs)))
            for name, a in sorted(rows, key=lambda x: x[0] == REFERENCE_APPLY):
                print(f"| {name} | " + " | ".join(_f(a[str(b)]["us"]) for b in bs) + " | " +
                      " | ".join(_f(a[str(b)]["first_ms"], 2) for b in bs) + " |")
