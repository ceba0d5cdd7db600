"""Speculative decoding (prompt lookup) on outputs that repeat their prompt: code edits.

    python -m bench.spec_decode [--model DIR] [--batches 1,4,8] [--repeats 2] [--k 4]
                                [--sampled] [--vllm-python PY --anchors DIR]

The workload: edit requests over real Python functions (this repository's own engine code),
"rename X to Y and return the whole function", through the model's chat template; a real model
(default: the built-in SmolLM2-135M-Instruct) copies most of the function back. Each request's output
length is fixed to what the model writes greedily without drafts (ignore_eos at that length), so every
run computes the same tokens. For each batch size B (B requests at once) streamer runs without and
with drafts, alternating, `--repeats` times; the greedy outputs of both must be equal token for token
(checked); `--sampled` adds the same at the anchors' sampled rules. With `--vllm-python`, vLLM's CPU
build runs the same token ids through the anchors' offline script, without and with its own ngram
speculative decoding. Output tok/s, ratios, acceptance.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness.machine import ROOT, wait_quiet
from bench.harness.vllm import SAMPLED, VLLM_FLAGS
from streamer import LLMEngine, SamplingParams
from streamer.config import EngineConfig
from workers.default_model import resolve_model

SOURCES = ("streamer/block_manager.py", "streamer/scheduler.py", "streamer/sampler.py")
RENAMES = (("seq", "sequence"), ("block_id", "block"), ("table", "block_table"), ("self", "this"))
# vLLM's offline script with its LLM(...) given a speculative config (the rest of it unchanged).
VLLM_SPEC = """
import sys
path, config = sys.argv[1], sys.argv.pop(2)
source = open(path).read()
call = "llm = LLM(**kw)"
assert source.count(call) == 1, "bench_vllm.py changed: its LLM(**kw) is not where expected"
source = source.replace(call, "kw['speculative_config'] = " + config + "\\n    " + call)
sys.argv = sys.argv[1:]
exec(compile(source, path, "exec"), {"__file__": path, "__name__": "__main__"})
"""


def functions(max_lines: int = 40, min_lines: int = 12) -> list[str]:
    """Functions of the engine's own source, 12-40 lines each."""
    found = []
    for name in SOURCES:
        source = (ROOT / name).read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                body = lines[node.lineno - 1:node.end_lineno]
                if min_lines <= len(body) <= max_lines:
                    indent = len(body[0]) - len(body[0].lstrip())
                    found.append("\n".join(line[indent:] for line in body))
    return found


def edit_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    prompts = []
    for i, code in enumerate(functions()[:count]):
        old, new = RENAMES[i % len(RENAMES)]
        ask = (f"Rename `{old}` to `{new}` in this Python function. Reply with the whole changed function "
               f"only.\n\n```python\n{code}\n```")
        prompts.append(engine.render_chat([{"role": "user", "content": ask}]))
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], lengths: list[int] | None, sampling: dict | None = None) -> dict:
    """All prompts at once, greedy unless `sampling`; lengths None: up to EOS (at most 256 tokens)."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=lengths[i] if lengths else 256,
                                ignore_eos=lengths is not None)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    wall = time.perf_counter() - start
    outputs = [tokens[str(i)] for i in range(len(prompts))]
    return {"wall_s": wall, "output_tok_s": sum(map(len, outputs)) / wall, "outputs": outputs}


def engine_for(model: Path, spec: dict | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", speculative_config=spec))


def streamer_side(args: argparse.Namespace, prompts: list[list[int]], lengths: list[int], batch: int,
                  sampling: dict | None = None) -> dict:
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engines = {"off": engine_for(args.model, None), "on": engine_for(args.model, spec)}
    times: dict[str, list[float]] = {"off": [], "on": []}
    outputs = {}
    for engine in engines.values():  # warm-up
        run(engine, prompts[:1], [8])
    for _ in range(args.repeats):
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            wait_quiet()
            result = run(engine, prompts[:batch], lengths[:batch], sampling)
            times[name].append(result["output_tok_s"])
            outputs[name] = result["outputs"]
    assert sampling or outputs["on"] == outputs["off"], "greedy outputs differ with drafts"
    stats = engines["on"].stats()
    for engine in engines.values():
        engine.shutdown()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    drafts = stats["spec_decode_num_draft_tokens"]
    return {"off_tok_s": off, "on_tok_s": on, "speedup": on / off,
            "acceptance": stats["spec_decode_num_accepted_tokens"] / drafts if drafts else 0.0,
            "per_pos": stats["spec_decode_num_accepted_tokens_per_pos"]}


def vllm_side(args: argparse.Namespace, prompts: list[list[int]], lengths: list[int], batch: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"prompt": p, "max_tokens": n} for p, n in zip(prompts[:batch], lengths[:batch])], f)
    script = str(Path(args.anchors) / "bench_vllm.py")
    common = [str(args.model), "--dtype", "float32", "--repeats", str(args.repeats), "--workload-file", f.name,
              *VLLM_FLAGS["main"]]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})
    result = {}
    for name, program in (("off", [script]), ("on", ["-c", VLLM_SPEC, script, spec])):
        wait_quiet()
        proc = subprocess.run([args.vllm_python, *program, *common], capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            result[f"{name}_error"] = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            continue
        result[f"{name}_tok_s"] = json.loads(lines[-1])["median_output_tok_s"]
    os.unlink(f.name)
    if "on_tok_s" in result and "off_tok_s" in result:
        result["speedup"] = result["on_tok_s"] / result["off_tok_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the built-in SmolLM2-135M-Instruct")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--sampled", action="store_true",
                    help="also streamer sampled (T 0.8, top-p 0.95, top-k 50) without and with drafts")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM CPU venv: run vLLM side by side")
    ap.add_argument("--anchors", default=None, help="folder holding bench_vllm.py (with --vllm-python)")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    probe = engine_for(args.model, None)
    prompts = edit_prompts(probe, max(batches))
    lengths = [max(16, len(out)) for out in run(probe, prompts, None)["outputs"]]
    probe.shutdown()
    print(json.dumps({"model": str(args.model.name), "prompts": len(prompts),
                      "prompt_tokens": [len(p) for p in prompts], "output_tokens": lengths}), flush=True)
    for batch in batches:
        row = {"batch": batch, "streamer": streamer_side(args, prompts, lengths, batch)}
        if args.sampled:
            row["streamer_sampled"] = streamer_side(args, prompts, lengths, batch, SAMPLED)
        if args.vllm_python:
            row["vllm"] = vllm_side(args, prompts, lengths, batch)
            if "on_tok_s" in row["vllm"]:
                row["streamer_on_vs_vllm_on"] = row["streamer"]["on_tok_s"] / row["vllm"]["on_tok_s"]
            row["streamer_on_vs_vllm_off"] = row["streamer"]["on_tok_s"] / row["vllm"].get("off_tok_s", float("nan"))
        print(json.dumps(row, default=lambda x: round(x, 3) if isinstance(x, float) else x), flush=True)


if __name__ == "__main__":
    main()
