"""Embeddings from a decoder model, as vLLM's pooling runner makes them: the prompt is computed once
(prefill only: no token is sampled, and its KV blocks are freed as soon as the last chunk ran), and
the final hidden states (after the model's last norm) are pooled, by the mean over the prompt's
tokens or by its last token, then L2-normalised unless asked not to.

The runner hands back, per chunk of a pooling sequence, the sum of the chunk's rows (mean) or the
last row of the prompt (last); `PoolingState` folds the chunks together, so a prompt longer than a
step's token budget pools exactly as one computed whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamer.sampling_params import SamplingParams

POOLING_TYPES = ("last", "mean")
# What vLLM pools a decoder model by when neither the checkpoint nor the request says.
DEFAULT_POOLING = "last"
# A pooling sequence never samples: its SamplingParams only fill the fields every sequence has.
PREFILL_ONLY = SamplingParams(max_tokens=1)
# sentence-transformers' pooling modes -> ours (the others, cls and max among them, are not served)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingParams:
    """What an embedding request asks for, as vLLM's PoolingParams: `pooling` None takes the engine's
    default (`EngineConfig.pooling`, else the checkpoint's), `dimensions` keeps the first d features
    (matryoshka models only, checked by the engine), before normalising."""

    pooling: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {list(POOLING_TYPES)}, not {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError("normalize must be a boolean")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError("dimensions must be a positive integer")


@dataclass(frozen=True)
class ModelPooling:
    """How this engine's model pools: its default pooling and normalisation, and the matryoshka
    dimensions it was trained for (None: not a matryoshka model, `dimensions` refused; empty: any)."""

    pooling: str = DEFAULT_POOLING
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None
    hidden_size: int = 0

    @classmethod
    def load(cls, root: Path, hf_config: Any, pooling: str | None) -> ModelPooling:
        """`pooling` (the engine's option) over the checkpoint's sentence-transformers config over
        vLLM's default for decoder models (last token, normalised)."""
        found = _sentence_transformers_pooling(root)
        normalize = found[1] if found is not None else True
        chosen = pooling or (found[0] if found is not None else None) or DEFAULT_POOLING
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        matryoshka = tuple(int(d) for d in dims) if dims else () if getattr(hf_config, "is_matryoshka", False) \
            else None
        return cls(chosen, normalize, matryoshka, int(hf_config.hidden_size))

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's params with the model's default pooling; ValueError for `dimensions` this
        model cannot give."""
        d = params.dimensions
        if d is not None:
            if self.matryoshka is None:
                raise ValueError("this model does not support `dimensions`: it is not a matryoshka model "
                                 "(its config.json sets neither is_matryoshka nor matryoshka_dimensions)")
            if self.matryoshka and d not in self.matryoshka:
                raise ValueError(f"`dimensions` {d} is not one this model was trained for: {list(self.matryoshka)}")
            if d > self.hidden_size:
                raise ValueError(f"`dimensions` {d} is more than the model's {self.hidden_size} features")
        return PoolingParams(params.pooling or self.pooling, params.normalize, d)


def _sentence_transformers_pooling(root: Path) -> tuple[str | None, bool] | None:
    """(pooling, normalize) from a sentence-transformers checkpoint's modules.json and its Pooling
    module's config (how Qwen3-Embedding says it pools by the last token); None without them."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    pooling = None
    for module in modules:
        if str(module.get("type", "")).endswith(".Pooling"):
            config_file = root / module.get("path", "") / "config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            pooling = next((ours for mode, ours in _ST_MODES.items() if config.get(mode)), None)
    return pooling, normalize


def chunk_partial(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """What a chunk's pooled rows (in token order) add, in float32: their sum (mean), the last (last)."""
    return hidden.float().sum(0) if pooling == "mean" else hidden[-1].float()


@dataclass(eq=False)
class PoolingState:
    """One pooling sequence's pool so far; `add` a chunk's partial as each chunk is computed."""

    params: PoolingParams
    total: torch.Tensor | None = field(default=None, repr=False)
    count: int = 0

    def add(self, start: int, partial: torch.Tensor | None, num_tokens: int) -> None:
        """The chunk that computed tokens [start, start + num_tokens); a chunk at 0 starts over (the
        sequence was preempted and is recomputed)."""
        if start == 0:
            self.total, self.count = None, 0
        if partial is None:  # last-token pooling: only the prompt's last chunk has a row
            return
        self.total = partial if self.params.pooling == "last" or self.total is None else self.total + partial
        self.count += num_tokens

    def result(self) -> list[float]:
        assert self.total is not None, "pooled before its last chunk ran"
        vector = self.total / self.count if self.params.pooling == "mean" else self.total
        if self.params.dimensions is not None:
            vector = vector[:self.params.dimensions]
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        return vector.tolist()
