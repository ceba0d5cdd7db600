"""How many tokens each decoding sequence may have guessed for it in a step (speculative decoding):
the scheduler asks its proposer for all of them at once, since a draft model guesses in one batch."""

from __future__ import annotations

from collections.abc import Container

from streamer.request import Sequence
from streamer.spec_decode.rejection_sampler import can_verify


def draft_room(running: list[Sequence], forking: Container[int], budget: int, num_speculative_tokens: int,
               max_model_len: int) -> dict[Sequence, int]:
    """The decoding sequences that may draft (a prompt's last row, one whose samples fork from it
    (`forking`: seq ids) or one whose sampling cannot be verified may not), each with as many drafts as
    the budget, the model's length and its request's max_tokens leave room for (a draft past the end
    would be thrown away)."""
    wanted = {}
    for seq in running:
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens \
                or seq.seq_id in forking or not can_verify(seq):
            continue
        max_tokens = seq.params.max_tokens
        room = min(num_speculative_tokens, budget - 1, max_model_len - seq.num_tokens,
                   max_tokens - seq.num_output_tokens - 1 if max_tokens is not None else budget)
        if room > 0:
            wanted[seq] = room
    return wanted
