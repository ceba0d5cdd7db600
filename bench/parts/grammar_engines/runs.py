"""One library's full run on one tokenizer: compile, fills, mask application and the feature matrix
(bench/grammar_engines.py)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.parts.grammar_engines.gil import overlap_ratio
from bench.parts.grammar_engines.grammars import _INT, _STR, _obj, documents
from bench.parts.grammar_engines.libraries import ENGINES, Engine, apply_reference
from bench.parts.grammar_engines.walks import _allowed, timed_repeats, walk_batch, walk_single


def apply_test(fn: Callable[[torch.Tensor, torch.Tensor], None], name: str, vocab: int, mask: torch.Tensor,
               batches: tuple[int, ...], iters: int) -> dict:
    """Microseconds to apply `mask` rows (real masks, taken mid-walk) to float32 logits [B, vocab]."""
    out: dict[str, Any] = {}
    for B in batches:
        bitmask = mask[torch.arange(B) % mask.shape[0]].contiguous()
        logits = torch.randn(B, vocab)
        a = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(logits, bitmask)
        first = time.perf_counter() - a
        expect = torch.zeros(B, vocab)
        apply_reference(expect, bitmask)
        if not torch.equal(torch.isfinite(logits), torch.isfinite(expect)):
            raise AssertionError(f"{name}: apply left other tokens than the mask")
        times = []
        for _ in range(iters):
            a = time.perf_counter()
            fn(logits, bitmask)
            times.append(time.perf_counter() - a)
        out[str(B)] = {"first_ms": first * 1e3, "us": statistics.median(times) * 1e6}
    return out


# JSON-schema keywords: (schema, a valid instance, an instance that breaks only that keyword); each is
# checked as the value of a property ({"x": ...}) of a closed object.
FEATURES: dict[str, tuple[dict, Any, Any]] = {
    "pattern": ({"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "AB-123", "AB-12"),
    "format: date-time": ({"type": "string", "format": "date-time"}, "2026-12-01T09:30:00Z", "2026-13-01T09:30:00Z"),
    "format: email": ({"type": "string", "format": "email"}, "ada@example.com", "ada.example.com"),
    "format: uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    "minLength / maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcde"),
    "integer minimum / maximum": ({"type": "integer", "minimum": 1, "maximum": 5}, 3, 7),
    "number exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 10, 7),
    "minItems / maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                            [1, 2], [1, 2, 3]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    [1, "a"], ["a", 1]),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": "x"}, "x", "y"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3, True),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
              {"a": 1, "b": "x"}, {"a": 1}),
    "required (closed object)": (_obj({"a": _INT, "b": _STR}, ["a"]), {"a": 1}, {"b": "x"}),
    "keys in another order": (_obj({"a": _INT, "b": _STR}, ["a"]), {"b": "x", "a": 1}, {"a": 1, "c": 2}),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                     {"x": 1}, {"x": "s"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"m": 1}),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      {"a": 1}, {"a": 1, "b": 2}),
    "$ref / $defs (recursive)": (
        {"$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
            "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
        {"v": 1, "next": {"v": 2, "next": None}}, {"v": 1, "next": {"v": "x", "next": None}}),
    "if / then / else": ({"type": "object", "properties": {"k": {"enum": ["n", "s"]}, "v": {}},
                          "required": ["k", "v"], "if": {"properties": {"k": {"const": "n"}}},
                          "then": {"properties": {"v": {"type": "integer"}}},
                          "else": {"properties": {"v": {"type": "string"}}}},
                         {"k": "n", "v": 1}, {"k": "n", "v": "x"}),
    "not": ({"not": {"type": "string"}}, 1, "s"),
}


def _accepts(eng: Engine, compiled: Any, tokens: list[int], vocab: int, eos: int) -> bool:
    """Whether the matcher takes every token of a text and then allows the end of sequence."""
    m = eng.matcher(compiled)
    for t in tokens:
        if not eng.accept(m, t):
            return False
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    eng.fill(m, bitmask, 0)
    return _allowed(bitmask, 0, eos)


@contextlib.contextmanager
def _native_stderr_silenced() -> Any:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def feature_matrix(eng: Engine, tok: Tokenizer) -> dict[str, str]:
    """Per keyword: enforced, ignored (the breaking instance passes), rejects valid, or refused."""
    out = {}
    for name, (schema, good, bad) in FEATURES.items():
        # Inside an object, so that the end of the value is marked (`}`) in every library.
        inner = {k: v for k, v in schema.items() if k != "$defs"}
        wrapped = {**_obj({"x": inner}), **({"$defs": schema["$defs"]} if "$defs" in schema else {})}
        good, bad = {"x": good}, {"x": bad}
        try:
            with _native_stderr_silenced():  # xgrammar logs unsupported keywords from C++
                compiled = eng.compile_schema(wrapped)
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            out[name] = "refused: " + str(exc).split("\n")[0][:60]
            continue
        ok = [_accepts(eng, compiled, tok.hf.encode(json.dumps(x), add_special_tokens=False), tok.vocab_size,
                       tok.hf.eos_token_id) for x in (good, bad)]
        out[name] = {(True, False): "enforced", (True, True): "ignored", (False, False): "rejects valid",
                     (False, True): "inverted"}[tuple(ok)]
    return out


@dataclass
class Tokenizer:
    name: str
    hf: Any
    vocab_size: int  # the model's logits width


def tokenizers(tmp: Path, quick: bool) -> tuple[list[Tokenizer], list[str]]:
    """The random 32k BPE (4k with `quick`) and, unless `quick`, the default model's tokenizer
    when it is already converted on this machine (never downloaded or converted here)."""
    from transformers import AutoTokenizer

    from streamer.random_checkpoint import build_tokenizer
    from workers.default_model import default_model_dir, is_converted, resolve_model

    notes = []
    size = 4096 if quick else 32000
    with contextlib.redirect_stderr(io.StringIO()):
        build_tokenizer(size, tmp / "tok")
    toks = [Tokenizer(f"random BPE {size // 1000}k", AutoTokenizer.from_pretrained(str(tmp / "tok")), size)]
    if quick:
        notes.append("--quick: a 4k random tokenizer only, no any-JSON case, fewer repeats (a smoke run, not "
                     "numbers to quote)")
    elif is_converted(default_model_dir()):
        path = resolve_model(None)
        cfg = json.loads((path / "config.json").read_text())
        hf = AutoTokenizer.from_pretrained(str(path))
        toks.append(Tokenizer("SmolLM2 49k", hf, int(cfg.get("vocab_size") or len(hf))))
    else:
        notes.append("default model (SmolLM2) not converted on this machine: its tokenizer is skipped "
                     "(`streamer up` converts it once)")
    return toks, notes


@dataclass
class Settings:
    repeats: int
    compile_budget_s: float
    walk_repeats: int
    batches: tuple[int, ...]
    batch_cases: tuple[str, ...]
    apply_iters: int
    cases: tuple[str, ...]
    batches_apply: tuple[int, ...]
    features: bool = True


def run_library(lib: str, tok: Tokenizer, s: Settings, reference: bool = False) -> dict:
    eng = ENGINES[lib]()
    res: dict[str, Any] = {"cases": {}}
    a = time.perf_counter()
    eng.prepare(tok.hf, tok.vocab_size)
    res["prepare_s"] = time.perf_counter() - a
    if s.features:
        res["features"] = feature_matrix(eng, tok)
    eos = tok.hf.eos_token_id
    mask = None  # a batch of real masks (mid-walk), for the apply test
    for case in s.cases:
        r: dict[str, Any] = {}
        res["cases"][case] = r
        if not eng.supports(case):
            r.update(supported=False, error="not supported")
            continue
        try:
            ctime, times, compiled = timed_repeats(lambda c=case: eng.compile(c), s.repeats, s.compile_budget_s)
        except Exception as exc:  # noqa: BLE001 - a library's refusal is a result
            r.update(supported=False, error=f"compile error: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        r.update(supported=True, compile_ms=ctime * 1e3, compile_repeats=len(times))
        # The last compile has not been used yet: its first mask is what a new request waits for.
        bm = torch.zeros((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
        m = eng.matcher(compiled)
        b = time.perf_counter()
        eng.fill(m, bm, 0)
        r["first_mask_ms"] = (time.perf_counter() - b) * 1e3
        r["new_matcher_us"] = timed_repeats(lambda c=compiled: eng.matcher(c), 5, 0.3)[0] * 1e6
        doc = tok.hf.encode(documents(case, 1, seed=1)[0], add_special_tokens=False)
        try:
            cold = walk_single(eng, compiled, doc, tok.vocab_size, eos, check=True)
        except AssertionError as exc:
            r["walk_error"] = f"rejects a valid output ({exc})"
            continue
        r["cold_walk_mask_mean_us"] = cold["mask_mean_us"]
        walks = [walk_single(eng, compiled, doc, tok.vocab_size, eos, check=False) for _ in range(s.walk_repeats)]
        r["b1"] = {k: statistics.median(w[k] for w in walks) for k in walks[0]}
        # Resume after a crash = replay the streamed tokens; beam search = fork a matcher mid-way.
        m = eng.matcher(compiled)
        a = time.perf_counter()
        for t in doc[: len(doc) // 2]:
            eng.accept(m, t)
        r["replay_half_ms"] = (time.perf_counter() - a) * 1e3
        r["fork_us"] = timed_repeats(lambda m=m: eng.fork(m), 10, 0.3)[0] * 1e6
        if case not in s.batch_cases:
            continue
        for B in s.batches:
            docs = [tok.hf.encode(d, add_special_tokens=False) for d in documents(case, B, seed=100 + B)]
            runs = [walk_batch(eng, compiled, docs, tok.vocab_size, check=(i == 0),
                               keep_mask_at=min(map(len, docs)) // 3) for i in range(s.walk_repeats)]
            mask = runs[0]["kept_mask"]
            r[f"b{B}"] = {k: statistics.median(w[k] for w in runs) for k in runs[0] if k != "kept_mask"}
            if max(s.batches) == B and eng.batched_api:
                loop = walk_batch(eng, compiled, docs, tok.vocab_size, batched=False)
                r[f"b{B}_loop"] = {k: v for k, v in loop.items() if k != "kept_mask"}
        for key, batched in (("overlap", False), ("overlap_batched", True)):
            if batched and not eng.batched_api:
                continue
            r[key] = overlap_ratio(functools.partial(walk_batch, eng, compiled, docs, tok.vocab_size, batched))
    if mask is not None:
        variants = dict(eng.apply_variants())
        if reference:
            variants[REFERENCE_APPLY] = apply_reference
        res["apply"] = {name: apply_test(fn, name, tok.vocab_size, mask, s.batches_apply, s.apply_iters)
                        for name, fn in variants.items()}
        res["apply_allowed_per_row"] = _popcount(mask) / mask.shape[0]
    return res


REFERENCE_APPLY = "plain torch, no compile (unpack bits, masked_fill_)"


def _popcount(bitmask: torch.Tensor) -> int:
    shifts = torch.arange(32, dtype=torch.int32)
    return int(((bitmask.unsqueeze(-1) >> shifts) & 1).sum())
