"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from streamer.structured_outputs import check_spec

_INT64_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the model's maximum length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per token (0 = only the chosen token's)
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0
    early_stopping: bool = False
    # What the output must match (structured_outputs.py): a JSON schema, any JSON, a regex, a choice
    # or a grammar; None: unconstrained.
    structured_outputs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from untrusted input: unknown fields are an error, not silently dropped."""
        if not isinstance(data, dict):
            raise ValueError("params must be an object/map")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        self._check_ranges()

    def _check_types(self) -> None:
        ints = ("n", "top_k", "min_tokens", "beam_width")
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "length_penalty")
        for name in ints:
            _require(_is_int(getattr(self, name)), f"{name} must be an integer")
        for name in floats:
            value = getattr(self, name)
            _require(_is_number(value), f"{name} must be a number")
            setattr(self, name, float(value))
        for name in ("seed", "max_tokens", "logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), f"{name} must be an integer or null")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "use_beam_search",
                     "early_stopping"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be true or false")
        _require(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
                 "stop must be a string or a list of strings")
        _require(isinstance(self.stop_token_ids, list) and all(_is_int(t) for t in self.stop_token_ids),
                 "stop_token_ids must be a list of integers")

    def _check_ranges(self) -> None:
        _require(1 <= self.n <= 64, f"n must be in [1, 64], got {self.n}")
        _require(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.seed is None or 0 <= self.seed <= _INT64_MAX, "seed must be in [0, 2**63-1]")
        _require(self.max_tokens is None or self.max_tokens >= 1,
                 f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 "min_tokens must not exceed max_tokens")
        _require(all(s for s in self.stop), "stop strings must not be empty")
        _require(len(self.stop) <= 16, "at most 16 stop strings")
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _require(len(self.stop_token_ids) <= 1024, "at most 1024 stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        _require(0.0 < self.repetition_penalty <= 2.0,
                 f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _require(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")
        _require(1 <= self.beam_width <= 32, f"beam_width must be in [1, 32], got {self.beam_width}")
        _require(-10.0 <= self.length_penalty <= 10.0, "length_penalty must be in [-10, 10]")
        if self.structured_outputs is not None:
            self.structured_outputs = check_spec(self.structured_outputs)
            _require(not self.use_beam_search, "structured_outputs is not supported with beam search")
        if self.use_beam_search:
            _require(self.n == 1, "beam search returns beam_width outputs: leave n at 1")
            _require(not self.stop, "stop strings are not supported with beam search (use stop_token_ids)")
            _require(self.logprobs is None, "logprobs are not supported with beam search")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


class InvalidParam(ValueError):
    """A sampling parameter out of its type or range; `param` names it (None: several at once)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _require(ok: bool, message: str) -> None:
    # Every message starts with the parameter it is about, when it is about one: that names it.
    if not ok:
        first = message.split(" ", 1)[0]
        raise InvalidParam(message, first if first in _FIELDS else None)
