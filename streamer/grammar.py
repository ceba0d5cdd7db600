"""Constrained decoding with xgrammar: compiling a request's structured_outputs spec (cached by spec),
one matcher per sequence, and the token mask the sampler applies (docs/structured_outputs.md has why
xgrammar).

xgrammar is imported on first use: an engine that never sees a constrained request never loads it.
JSON is generated without free whitespace (`any_whitespace=False`): a model may otherwise pad with
spaces and newlines until it runs out of tokens, and compact JSON parses the same.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from streamer.errors import GrammarError
from streamer.structured_outputs import spec_key

CACHE_SIZE = 256  # compiled grammars kept, by spec


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe (prompts are prepared off the engine thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: dict[str, Any]) -> Any:
        key = spec_key(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: dict[str, Any]) -> Any:
        ((kind, value),) = spec.items()
        c = self._compiler
        try:
            if kind == "json":
                schema = value if isinstance(value, dict) else {}
                ignored = sorted(_ignored_keywords(schema))
                if ignored:
                    raise GrammarError(f"structured_outputs.json uses {', '.join(ignored)}, which the grammar "
                                       "engine would not enforce: the output could break the schema")
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            if kind == "regex":
                re.compile(value)  # Python's own message first: clearer than the engine's
                return c.compile_regex(value)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in value))
            return c.compile_grammar(value)
        except re.error as e:
            raise GrammarError(f"structured_outputs.regex does not compile: {e}") from None
        except Exception as e:  # xgrammar reports a bad schema or grammar as RuntimeError/ValueError
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(f"structured_outputs.{kind} does not compile: {message}"[:500]) from None

    def matcher(self, compiled: Any) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), self)


# JSON Schema keywords xgrammar 0.2 skips without a word (bench/grammar_engines.py checks each one):
# refused instead, so a schema is never enforced only in part.
IGNORED_KEYWORDS = frozenset({"uniqueItems", "allOf", "if", "then", "else", "not", "patternProperties"})
# Keywords whose value maps names to subschemas (the names themselves are not keywords).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})


def _ignored_keywords(schema: Any) -> set[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            found |= IGNORED_KEYWORDS & set(node)
            for key, value in node.items():
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in ("enum", "const", "default", "examples"):  # data, not schemas
                    stack.append(value)
    return found


class GrammarState:
    """Where one sequence is in its grammar."""

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self.matcher, self.compiler = matcher, compiler

    def accept(self, token: int) -> bool:
        """Advance by a sampled token (False: the grammar does not allow it, e.g. a forced EOS)."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token))

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.fork(), self.compiler)

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def apply_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set the logits of every token a row's grammar does not allow next to -inf, in place."""
    xgr = states[0].compiler._xgr
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, state in enumerate(states):
        if not state.matcher.is_terminated():
            state.matcher.fill_next_token_bitmask(bitmask, j)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=vocab)
    logits[rows] = sub
