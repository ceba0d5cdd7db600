"""The speculative-decoding options of an engine (vLLM's `speculative_config` keys)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from streamer.errors import ConfigError

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram": prompt lookup. The last `prompt_lookup_max` .. `prompt_lookup_min` tokens of a
    sequence are looked up in its own earlier tokens (prompt and output); the tokens that followed the
    most recent match are the guess, at most `num_speculative_tokens` of them. "draft_model": `model`,
    a smaller checkpoint of the same tokenizer, decodes them greedily (the method vLLM infers when
    only `model` is given, as here)."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if data is None or isinstance(data, SpeculativeConfig):
            return data
        if not isinstance(data, dict):
            raise ConfigError("speculative_config must be a mapping such as {'method': 'ngram', "
                              "'num_speculative_tokens': 4}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s): {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**data)

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        checks = [
            (self.method in METHODS, f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
             "num_speculative_tokens must be an integer in [1, 16]"),
            (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
             and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64,
             "prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max <= 64"),
            ((self.method == "draft_model") == isinstance(self.model, str) and self.model != "",
             "the draft_model method takes a draft checkpoint directory as `model`; ngram takes none"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
