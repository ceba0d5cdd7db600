"""What makes the guesses the target model verifies: prompt lookup or a draft model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from streamer.config import EngineConfig
from streamer.request import Sequence
from streamer.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from streamer.model_config import ModelConfig


class Proposer(Protocol):
    def propose_many(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Up to `wanted[seq]` guessed next tokens of each sequence (fewer, or none, when unsure)."""
        ...

    def shutdown(self) -> None:
        ...


def make_proposer(config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig, device: torch.device,
                  num_kv_blocks: int) -> Proposer:
    if spec.method == "ngram":
        from streamer.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec)
    from streamer.spec_decode.draft_proposer import DraftModelProposer

    assert spec.model is not None  # SpeculativeConfig checks it
    return DraftModelProposer(config, spec.model, target, device, num_kv_blocks)
