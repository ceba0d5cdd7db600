"""Prompt lookup: guess a sequence's next tokens from its own history.

Summaries, code edits, extraction and chat over a document repeat long runs of their prompt. When
the last few tokens occurred before, the tokens that followed them then are a cheap, often right
guess of what follows now; the target model checks the guess in the same forward that produces its
next token, so a right guess of k tokens saves k steps and a wrong one costs only the extra rows.
"""

from __future__ import annotations

import numpy as np

from streamer.request import Sequence
from streamer.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_many(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        return {seq: self.propose(seq.token_ids, k) for seq, k in wanted.items()}

    def shutdown(self) -> None:
        """Nothing held."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
        (`max_n` down to `min_n` tokens) of `token_ids`; none when no suffix occurred before."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Start of every earlier window equal to the suffix (the suffix itself excluded).
            starts = np.flatnonzero(tokens[:length - n] == suffix[0])
            for j in range(1, n):
                starts = starts[tokens[starts + j] == suffix[j]]
                if not starts.size:
                    break
            if starts.size:
                follow = starts[-1] + n
                return tokens[follow:follow + k].tolist()
        return []
