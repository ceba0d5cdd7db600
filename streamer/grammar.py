"""Constrained decoding with xgrammar: compiling a request's structured_outputs spec (cached by spec,
time-limited), one matcher per sequence, and the token mask the sampler applies, filled off the step
within budgets (docs/structured_outputs.md has why xgrammar, and the budgets).

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
from streamer.grammar_compile import CompilePool
from streamer.grammar_masks import Budgets, MaskFiller, RequestBudget
from streamer.structured_outputs import DATA_KEYWORDS, SCHEMA_MAPS, spec_key

CACHE_SIZE = 256  # compiled grammars kept, by spec


class GrammarCompiler:
    """Compiles specs for one tokenizer (thread-safe: prompts are prepared off the engine thread) in
    time-limited child processes (grammar_compile.py), and fills masks off the step (grammar_masks.py)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], budgets: Budgets,
                 compile_workers: int = 1, compile_timeout_s: float = 10.0) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=sorted(stop_token_ids) or None)
        self.stop_token_ids = frozenset(self._info.stop_token_ids)
        self.all_allowed = xgr.allocate_token_bitmask(1, vocab_size)
        self.masks = MaskFiller(budgets)
        self._pool = CompilePool(self._info.serialize_json(), compile_workers, compile_timeout_s)
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
        if kind == "json":
            schema = value if isinstance(value, dict) else {}
            ignored = sorted(_ignored_keywords(schema))
            if ignored:
                raise GrammarError(f"structured_outputs.json uses {', '.join(ignored)}, which the grammar "
                                   "engine would not enforce: the output could break the schema")
            method, source = "json_schema", json.dumps(schema)
        elif kind == "json_object":
            method, source = "json_schema", json.dumps({"type": "object"})
        elif kind == "regex":
            try:
                re.compile(value)  # Python's own message first: clearer than the engine's
            except re.error as e:
                raise GrammarError(f"structured_outputs.regex does not compile: {e}") from None
            method, source = "regex", value
        elif kind == "choice":
            method, source = "grammar", "root ::= " + " | ".join(json.dumps(choice) for choice in value)
        else:
            method, source = "grammar", value
        serialized = self._pool.compile(method, source, f"structured_outputs.{kind}")
        return self._xgr.CompiledGrammar.deserialize_json(serialized, self._info)

    def budget(self, request_id: str) -> RequestBudget:
        """What one request's sequences spend on masks, together."""
        return RequestBudget(request_id)

    def matcher(self, compiled: Any, budget: RequestBudget) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), self, budget)

    def take_failures(self) -> dict[str, str]:
        """Requests whose masks went over a budget since the last call: request id -> why."""
        return self.masks.take_failures()

    def close(self) -> None:
        self._pool.close()


# JSON Schema keywords xgrammar 0.2 skips without a word (bench/grammar_engines.py checks each one):
# refused instead, so a schema is never enforced only in part.
IGNORED_KEYWORDS = frozenset({"uniqueItems", "allOf", "if", "then", "else", "not", "patternProperties"})


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
                if key in SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in DATA_KEYWORDS:
                    stack.append(value)
    return found


class GrammarState:
    """Where one sequence is in its grammar, and its next-token mask (`row`), filled off the step.

    The engine thread only reads the mask: `accept` checks a sampled token against it, and hands the
    token to the mask thread, which advances the matcher and fills the next mask (`fill`); until then
    the state is not `ready` and its sequence is not scheduled."""

    def __init__(self, matcher: Any, compiler: GrammarCompiler, budget: RequestBudget) -> None:
        self.matcher, self.compiler, self.budget = matcher, compiler, budget
        self.row = compiler._xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self._bits = self.row.numpy()  # the same memory: one bit read without a tensor op
        self._pending: list[int] = []  # accepted, not yet given to the matcher
        self.ready = False
        self.terminated = False
        self.last_fill_s = 0.0  # set by the mask thread

    def replay(self, tokens: list[int]) -> bool:
        """Bring a new state to where `tokens` leave it (a resumed request), then fill its first mask;
        False when the grammar does not allow them."""
        if not all(self.matcher.accept_token(t) for t in tokens):
            return False
        self.terminated = self.ready = bool(self.matcher.is_terminated())
        if not self.terminated:
            self.compiler.masks.submit(self)
        return True

    def accept(self, token: int) -> bool:
        """Advance by a sampled token (False: the grammar does not allow it, e.g. a forced EOS)."""
        if self.terminated or not self.ready or not (self._bits[0, token >> 5] >> (token & 31)) & 1:
            return False
        if token in self.compiler.stop_token_ids:  # allowed only where the grammar may end: it has
            self.terminated = True
            return True
        self._pending.append(token)
        self.ready = False
        self.compiler.masks.submit(self)
        return True

    def fill(self) -> None:
        """On the mask thread: accept the pending tokens, fill the next mask."""
        tokens, self._pending = self._pending, []
        for t in tokens:
            self.matcher.accept_token(t)  # drawn under this grammar's mask: allowed
        self.matcher.fill_next_token_bitmask(self.row, 0)
        self.ready = True

    def mask(self) -> torch.Tensor:
        if self.terminated:
            return self.compiler.all_allowed
        if not self.ready:  # the scheduler runs only sequences whose mask is ready
            raise RuntimeError("structured_outputs: a sequence was scheduled before its token mask was ready")
        return self.row


def apply_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set the logits of every token a row's grammar does not allow next to -inf, in place."""
    xgr = states[0].compiler._xgr
    vocab = logits.shape[1]
    bitmask = torch.cat([state.mask() for state in states])
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=vocab)
    logits[rows] = sub
