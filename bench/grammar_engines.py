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
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import io
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.progress_display import task

LIBRARIES = ("xgrammar", "llguidance", "outlines-core")
DIST_NAMES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}


# ---- the grammars ---------------------------------------------------------------------------

def _obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object (no extra keys, the same meaning in all three libraries)."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


_NUM, _INT, _STR, _BOOL = {"type": "number"}, {"type": "integer"}, {"type": "string"}, {"type": "boolean"}
_DATE_TIME = {"type": "string", "format": "date-time"}

SCHEMA: dict = {"title": "Order", **_obj({
    "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    "created_at": _DATE_TIME,
    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "gift": _BOOL,
    "customer": _obj({
        "id": _INT,
        "name": {"type": "string", "maxLength": 60},
        "email": {"type": "string", "format": "email"},
        "tier": {"enum": ["free", "plus", "pro"]},
        "address": _obj({
            "street": _STR, "city": _STR, "postal_code": _STR,
            "country": {"enum": ["DE", "FR", "GB", "US", "JP"]},
            "geo": _obj({"lat": _NUM, "lon": _NUM, "accuracy": {"enum": ["exact", "street", "city"]}}),
        }),
    }),
    "items": {"type": "array", "minItems": 1, "items": _obj({
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": _STR,
        "quantity": {"type": "integer", "minimum": 1},
        "unit_price": _NUM,
        "tags": {"type": "array", "items": _STR, "maxItems": 3},
        "dimensions": _obj({"width": _NUM, "height": _NUM, "depth": _NUM, "unit": {"enum": ["cm", "in"]}}),
    }, ["sku", "name", "quantity", "unit_price", "dimensions"])},
    "shipping": _obj({
        "method": {"enum": ["standard", "express", "pickup"]},
        "carrier": _STR,
        "tracking": _obj({
            "number": _STR,
            "events": {"type": "array", "items": _obj({
                "timestamp": _DATE_TIME, "location": _STR,
                "code": {"enum": ["created", "picked_up", "in_transit", "delivered"]},
            })},
        }),
    }),
    "payment": _obj({"method": {"enum": ["card", "paypal", "invoice"]}, "amount": _NUM,
                     "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]}, "captured": _BOOL}),
    "notes": {"anyOf": [_STR, {"type": "null"}]},
    "metadata": _obj({"source": {"enum": ["web", "app", "phone"]},
                      "campaign": {"anyOf": [_STR, {"type": "null"}]}, "version": _INT}, ["source", "version"]),
}, ["order_id", "status", "created_at", "priority", "customer", "items", "shipping", "payment"])}

REGEX_DATE_TIME = (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d"
                   r"(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})")
REGEX_EMAIL = r"[a-z0-9._%+-]{1,64}@[a-z0-9-]{1,63}(\.[a-z0-9-]{1,63})*\.[a-z]{2,12}"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]
# The same arithmetic grammar in each library's dialect: GBNF-style EBNF (xgrammar), Lark (llguidance).
EBNF_ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""
LARK_ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""

# case name -> what it is, in the table
CASES = {
    "json_schema": "nested JSON schema (49 props)",
    "json_object": "any JSON object",
    "regex_datetime": "regex: ISO date-time",
    "regex_email": "regex: email-like",
    "choice5": "choice of 5 strings",
    "ebnf_arith": "EBNF: arithmetic",
}

_WORDS = ["alpha", "bravo", "Köln", "straße", "north", "quick", "blue", "parcel", "fragile", "Zürich", "depot",
          "express", "café", "gate 7", "warehouse", "12b", "left", "dock", "night", "München", "spare"]


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def _stamp(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:" \
           f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"


def make_order(rng: random.Random) -> dict:
    """A random instance of SCHEMA (properties in schema order, some optional ones left out)."""
    doc: dict[str, Any] = {
        "order_id": f"ORD-{rng.randint(0, 999999):06d}",
        "status": rng.choice(SCHEMA["properties"]["status"]["enum"]),
        "created_at": _stamp(rng),
        "priority": rng.randint(1, 5),
    }
    if rng.random() < 0.5:
        doc["gift"] = rng.random() < 0.5
    doc["customer"] = {
        "id": rng.randint(1, 10**7), "name": _text(rng, 1, 3),
        "email": f"{rng.choice(_WORDS[:2])}.{rng.randint(1, 999)}@example.com",
        "tier": rng.choice(["free", "plus", "pro"]),
        "address": {"street": f"{_text(rng, 1, 2)} {rng.randint(1, 200)}", "city": rng.choice(_WORDS),
                    "postal_code": f"{rng.randint(10000, 99999)}",
                    "country": rng.choice(["DE", "FR", "GB", "US", "JP"]),
                    "geo": {"lat": round(rng.uniform(-90, 90), 4), "lon": round(rng.uniform(-180, 180), 4),
                            "accuracy": rng.choice(["exact", "street", "city"])}},
    }
    items = []
    for _ in range(rng.randint(1, 3)):
        item: dict[str, Any] = {"sku": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
                                + f"-{rng.randint(0, 9999):04d}",
                                "name": _text(rng, 1, 3), "quantity": rng.randint(1, 20),
                                "unit_price": round(rng.uniform(0.5, 500), 2)}
        if rng.random() < 0.6:
            item["tags"] = [rng.choice(_WORDS) for _ in range(rng.randint(0, 3))]
        item["dimensions"] = {"width": round(rng.uniform(1, 100), 1), "height": round(rng.uniform(1, 100), 1),
                              "depth": round(rng.uniform(1, 100), 1), "unit": rng.choice(["cm", "in"])}
        items.append(item)
    doc["items"] = items
    doc["shipping"] = {
        "method": rng.choice(["standard", "express", "pickup"]), "carrier": rng.choice(["DHL", "UPS", "La Poste"]),
        "tracking": {"number": f"{rng.randint(10**9, 10**10)}", "events": [
            {"timestamp": _stamp(rng), "location": rng.choice(_WORDS),
             "code": rng.choice(["created", "picked_up", "in_transit", "delivered"])}
            for _ in range(rng.randint(0, 2))]},
    }
    doc["payment"] = {"method": rng.choice(["card", "paypal", "invoice"]), "amount": round(rng.uniform(1, 2000), 2),
                      "currency": rng.choice(["EUR", "USD", "GBP", "JPY"]), "captured": rng.random() < 0.7}
    if rng.random() < 0.5:
        doc["notes"] = _text(rng, 2, 6) if rng.random() < 0.7 else None
    if rng.random() < 0.7:
        meta: dict[str, Any] = {"source": rng.choice(["web", "app", "phone"])}
        if rng.random() < 0.5:
            meta["campaign"] = rng.choice([None, "winter-sale", "newsletter"])
        meta["version"] = rng.randint(1, 9)
        doc["metadata"] = meta
    return doc


def documents(case: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct valid outputs for a case."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if case == "json_schema":
            out.append(json.dumps(make_order(rng), ensure_ascii=False))
        elif case == "json_object":  # a generic object, 3 levels deep (outlines-core's default depth limit)
            out.append(json.dumps({"id": i, "title": _text(rng, 2, 5), "score": round(rng.uniform(0, 1), 3),
                                   "tags": [rng.choice(_WORDS) for _ in range(rng.randint(1, 4))],
                                   "author": {"name": _text(rng, 1, 2), "verified": rng.random() < 0.5,
                                              "stats": {"posts": rng.randint(0, 999), "karma": None}}},
                                  ensure_ascii=False))
        elif case == "regex_datetime":
            out.append(_stamp(rng).replace("Z", rng.choice(["Z", ".125+02:00", "-05:30"])))
        elif case == "regex_email":
            out.append(f"{rng.choice(['ada', 'grace.hopper', 'linus_t'])}{rng.randint(1, 99)}@"
                       f"{rng.choice(['example', 'mail-server'])}.{rng.choice(['com', 'co.uk', 'org'])}")
        elif case == "choice5":
            out.append(rng.choice(CHOICES))
        elif case == "ebnf_arith":
            out.append(f"({rng.randint(1, 99)}+{rng.uniform(0, 9):.2f})*{rng.randint(2, 9)}-"
                       f"{rng.randint(1, 999)}/(-{rng.randint(1, 9)}+({rng.randint(1, 50)}*2.5-1))")
    return out


# ---- the three libraries behind one small interface -----------------------------------------

class Engine:
    """One library: its tokenizer preparation, compilers, matchers and mask functions."""

    name = ""
    batched_api = ""  # the batched mask call, if the library has one

    def prepare(self, tok: Any, vocab_size: int) -> None:
        raise NotImplementedError

    def supports(self, case: str) -> bool:
        return True

    def compile(self, case: str) -> Any:
        raise NotImplementedError

    def compile_schema(self, schema: dict) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def accept(self, m: Any, token: int) -> bool:
        raise NotImplementedError

    def fill_batch(self, ms: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        for m, r in zip(ms, rows):
            self.fill(m, bitmask, r)

    def accept_batch(self, ms: list, tokens: list[int]) -> list[bool]:
        return [self.accept(m, t) for m, t in zip(ms, tokens)]

    def fork(self, m: Any) -> Any:
        raise NotImplementedError

    def apply_variants(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        """The library's own ways to apply a bitmask to CPU logits, by name."""
        raise NotImplementedError


class XGrammar(Engine):
    name = "xgrammar"
    batched_api = "BatchGrammarMatcher.batch_fill_next_token_bitmask"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.batch = xgrammar.BatchGrammarMatcher()  # default threads: half the cores

    def prepare(self, tok: Any, vocab_size: int) -> None:
        self.info = self.xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        # No cache: every compile below is a real one (an engine would keep it on).
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)

    def compile(self, case: str) -> Any:
        c = self.compiler
        if case == "json_schema":
            return self.compile_schema(SCHEMA)
        if case == "json_object":
            return c.compile_builtin_json_grammar()
        if case == "regex_datetime":
            return c.compile_regex(REGEX_DATE_TIME)
        if case == "regex_email":
            return c.compile_regex(REGEX_EMAIL)
        if case == "choice5":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES))
        if case == "ebnf_arith":
            return c.compile_grammar(EBNF_ARITH)
        raise KeyError(case)

    def compile_schema(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def fill_batch(self, ms: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask, rows)

    def accept_batch(self, ms: list, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def fork(self, m: Any) -> Any:
        return m.fork()

    def apply_variants(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        apply = self.xgr.apply_token_bitmask_inplace
        return {"xgrammar: apply_token_bitmask_inplace (CPU default: C++ loop)": apply,
                "xgrammar: apply_token_bitmask_inplace(backend='torch_compile')":
                    functools.partial(apply, backend="torch_compile")}


class LLGuidance(Engine):
    name = "llguidance"
    batched_api = "LLExecutor (fill_next_token_bitmask_par)"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.executor = llguidance.LLExecutor()  # default threads: 80% of the cores

    def prepare(self, tok: Any, vocab_size: int) -> None:
        self.tok = self.llg.hf.from_tokenizer(tok, n_vocab=vocab_size)

    def compile(self, case: str) -> Any:
        M = self.llg.LLMatcher
        grammar = {
            "json_schema": lambda: M.grammar_from_json_schema(SCHEMA),
            "json_object": lambda: M.grammar_from_json_schema({"type": "object"}),
            "regex_datetime": lambda: M.grammar_from_regex(REGEX_DATE_TIME),
            "regex_email": lambda: M.grammar_from_regex(REGEX_EMAIL),
            "choice5": lambda: M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in CHOICES)),
            "ebnf_arith": lambda: M.grammar_from_lark(LARK_ARITH),
        }[case]()
        return self._matcher(grammar)

    def _matcher(self, grammar: str) -> Any:
        # The matcher is the compiled form: each request takes a deep copy of this one.
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile_schema(self, schema: dict) -> Any:
        return self._matcher(self.llg.LLMatcher.grammar_from_json_schema(schema))

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def fill_batch(self, ms: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, list(zip(ms, rows)), bitmask)

    def accept_batch(self, ms: list, tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(ms, tokens)))

    def fork(self, m: Any) -> Any:
        return m.deep_copy()

    def apply_variants(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        return {"llguidance: llguidance.torch.apply_token_bitmask_inplace (torch.compile)":
                self.llg.torch.apply_token_bitmask_inplace}


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table (byte-level BPE token strings)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def outlines_vocabulary_map(tok: Any) -> tuple[int, dict[bytes, list[int]]]:
    """(eos id, token bytes -> ids) for `outlines_core.Vocabulary`: its only constructor that
    works offline takes the vocabulary as bytes (`from_pretrained` fetches from the Hub)."""
    decoder = _byte_decoder()
    special = set(tok.all_special_ids)
    added = {t.content for t in tok.added_tokens_decoder.values()}
    out: dict[bytes, list[int]] = {}
    for token, i in tok.get_vocab().items():
        if i in special:
            continue
        if token in added or any(c not in decoder for c in token):
            raw = token.encode()  # added tokens are stored as plain text
        else:
            raw = bytes(decoder[c] for c in token)
        out.setdefault(raw, []).append(i)
    return tok.eos_token_id, out


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self) -> None:
        import outlines_core
        import outlines_core.kernels.torch

        self.oc = outlines_core

    def prepare(self, tok: Any, vocab_size: int) -> None:
        eos, mapping = outlines_vocabulary_map(tok)
        self.vocab = self.oc.Vocabulary(eos, mapping)

    def supports(self, case: str) -> bool:
        return case != "ebnf_arith"  # regular languages only: no context-free grammars

    def compile(self, case: str) -> Any:
        build = self.oc.json_schema.build_regex_from_schema
        regex = {
            "json_schema": lambda: build(json.dumps(SCHEMA)),
            "json_object": lambda: build(json.dumps({"type": "object"})),
            "regex_datetime": lambda: REGEX_DATE_TIME,
            "regex_email": lambda: REGEX_EMAIL,
            "choice5": lambda: "(" + "|".join(map(_re_escape, CHOICES)) + ")",
        }[case]()
        return self.oc.Index(regex, self.vocab)

    def compile_schema(self, schema: dict) -> Any:
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(json.dumps(schema)), self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.write_mask_into(bitmask.data_ptr() + row * bitmask.stride(0) * 4, bitmask.shape[1], 4)

    def accept(self, m: Any, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def fork(self, m: Any) -> Any:
        return copy.copy(m)

    def apply_variants(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        return {"outlines-core: kernels.torch.apply_token_bitmask_inplace (torch.compile)":
                self.oc.kernels.torch.apply_token_bitmask_inplace}


def _re_escape(s: str) -> str:
    return "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in s)


ENGINES: dict[str, Callable[[], Engine]] = {"xgrammar": XGrammar, "llguidance": LLGuidance,
                                            "outlines-core": OutlinesCore}


def apply_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch (no compile): unpack the bits and fill the disallowed logits with -inf."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


# ---- measurements ---------------------------------------------------------------------------

def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool(int(bitmask[row, token >> 5]) & (1 << (token & 31)))


def timed_repeats(fn: Callable[[], Any], repeats: int, budget_s: float) -> tuple[float, list[float], Any]:
    """Median seconds of up to `repeats` calls (fewer once `budget_s` is spent, at least one)."""
    times, result = [], None
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), times, result


def walk_single(eng: Engine, compiled: Any, tokens: list[int], vocab: int, eos: int, check: bool) -> dict:
    """Batch 1: fill + accept each token of one document; per-token microseconds."""
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    m = eng.matcher(compiled)
    fills, accepts = [], []
    clock = time.perf_counter_ns
    for t in tokens:
        a = clock()
        eng.fill(m, bitmask, 0)
        b = clock()
        if check and not _allowed(bitmask, 0, t):
            raise AssertionError(f"{eng.name}: token {t} not allowed by its mask")
        c = clock()
        ok = eng.accept(m, t)
        d = clock()
        if not ok:
            raise AssertionError(f"{eng.name}: token {t} rejected")
        fills.append((b - a) / 1e3)
        accepts.append((d - c) / 1e3)
    a = clock()
    eng.fill(m, bitmask, 0)
    fills.append((clock() - a) / 1e3)
    if check and not _allowed(bitmask, 0, eos):
        raise AssertionError(f"{eng.name}: end of sequence not allowed after a complete document")
    return {"mask_mean_us": statistics.fmean(fills), "mask_p99_us": _p99(fills),
            "accept_mean_us": statistics.fmean(accepts), "tokens": len(tokens)}


def walk_batch(eng: Engine, compiled: Any, docs: list[list[int]], vocab: int, batched: bool = True,
               check: bool = False, keep_mask_at: int = -1) -> dict:
    """Batch B: each matcher walks its own document; one bitmask [B, vocab/32] filled per step."""
    B = len(docs)
    bitmask = torch.zeros((B, (vocab + 31) // 32), dtype=torch.int32)
    ms = [eng.matcher(compiled) for _ in range(B)]
    fill = eng.fill_batch if batched else Engine.fill_batch.__get__(eng)
    accept = eng.accept_batch if batched else Engine.accept_batch.__get__(eng)
    per_token, steps, fill_total, acc_total, n_tokens, kept = [], [], 0.0, 0.0, 0, None
    for pos in range(max(map(len, docs))):
        rows = [i for i in range(B) if pos < len(docs[i])]
        active = [ms[i] for i in rows]
        toks = [docs[i][pos] for i in rows]
        a = time.perf_counter()
        fill(active, bitmask, rows)
        b = time.perf_counter()
        if check:
            for r, t in zip(rows, toks):
                if not _allowed(bitmask, r, t):
                    raise AssertionError(f"{eng.name}: batched mask disallows token {t} of row {r}")
        if pos == keep_mask_at:
            kept = bitmask.clone()
        c = time.perf_counter()
        ok = accept(active, toks)
        d = time.perf_counter()
        if not all(ok):
            raise AssertionError(f"{eng.name}: a batched accept failed")
        steps.append(b - a)
        per_token.append((b - a) * 1e6 / len(rows))
        fill_total += b - a
        acc_total += d - c
        n_tokens += len(rows)
    return {"mask_mean_us": fill_total * 1e6 / n_tokens, "mask_p99_us": _p99(per_token),
            "step_mean_ms": statistics.fmean(steps) * 1e3, "step_p99_ms": _p99(steps) * 1e3,
            "accept_mean_us": acc_total * 1e6 / n_tokens, "tokens": n_tokens, "kept_mask": kept}


def fake_forward(n_ops: int) -> None:
    """Python-driven torch work: what the main thread does while it launches a forward pass."""
    x = _FWD_X
    for _ in range(n_ops):
        x = torch.tanh(x @ _FWD_W)


_FWD_X = torch.randn(16, 128)
_FWD_W = torch.randn(128, 128) / 12
_BUFFER = os.urandom(1 << 20)


def _python_loop(n: int) -> None:  # holds the GIL throughout
    total = 0
    for i in range(n):
        total += i * i


def _hashing(n: int) -> None:  # hashlib drops the GIL for large buffers
    import hashlib

    for _ in range(n):
        hashlib.sha256(_BUFFER).digest()


def _sized(fn: Callable[[int], None], seconds: float, probe: int) -> Callable[[], None]:
    """`fn` with its count chosen so that one call takes about `seconds`."""
    a = time.perf_counter()
    fn(probe)
    per = (time.perf_counter() - a) / probe
    n = max(1, round(seconds / per))
    return lambda: fn(n)


def overlap_ratio(background: Callable[[], None], repeats: int = 3) -> dict:
    """`background` in a worker thread while the main thread runs `fake_forward` for as long,
    against the two one after the other: ~0.5 when they overlap (the background work releases
    the GIL and a core is free), ~1.0 when it holds the GIL."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stand-in forward takes one core, the background work the other
    try:
        background()  # warm
        alone = statistics.median(_timed(background) for _ in range(repeats))
        foreground = _sized(fake_forward, alone, 200)
        serial = statistics.median(_timed(lambda: (background(), foreground())) for _ in range(repeats))

        def together() -> None:
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(background)
                foreground()
                fut.result()

        both = statistics.median(_timed(together) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return {"ratio": both / serial, "serial_ms": serial * 1e3, "threaded_ms": both * 1e3,
            "gil_wait_ms": gil_wait(background)}


def gil_wait(background: Callable[[], None]) -> float:
    """Median milliseconds the main thread waits for the GIL after a short sleep while
    `background` runs in a thread: ~0 when the background work releases it in its native calls,
    ~the switch interval (5 ms) when it holds it. Unlike the ratio, this does not need a free core."""
    done = threading.Event()

    def run() -> None:
        background()
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    waits = []
    while not done.is_set():
        a = time.perf_counter()
        time.sleep(0.0005)
        waits.append(time.perf_counter() - a - 0.0005)
    worker.join()
    return statistics.median(waits) * 1e3


def _timed(fn: Callable[[], Any]) -> float:
    a = time.perf_counter()
    fn()
    return time.perf_counter() - a


def gil_controls(seconds: float) -> dict:
    """The same test on work known to hold the GIL (a Python loop) and to release it (hashing)."""
    return {"holds (Python loop)": overlap_ratio(_sized(_python_loop, seconds, 100_000)),
            "releases (hashlib.sha256)": overlap_ratio(_sized(_hashing, seconds, 20))}


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


ENGINES_API = {"xgrammar": XGrammar.batched_api, "llguidance": LLGuidance.batched_api}
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
