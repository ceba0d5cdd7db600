"""xgrammar, llguidance and outlines-core behind one small interface, and the reference way to apply
a bitmask to logits (bench/grammar_engines.py)."""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from bench.parts.grammar_engines.grammars import CHOICES, EBNF_ARITH, LARK_ARITH, REGEX_DATE_TIME, REGEX_EMAIL, SCHEMA

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


# Which libraries fill a whole batch in one call (the others: a loop of single fills).
ENGINES_API = {"xgrammar": XGrammar.batched_api, "llguidance": LLGuidance.batched_api}
