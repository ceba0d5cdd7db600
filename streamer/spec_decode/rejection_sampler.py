"""Which guessed tokens a verification forward keeps, so that the output is distributed exactly as
without guessing.

A sequence with drafts d_0..d_{k-1} gets k + 1 rows of logits: row j is the target's distribution p_j
of the token after d_0..d_{j-1}. Draft j is kept with probability p_j(d_j) (a guess from prompt lookup
is a single token, a point mass: min(1, p/q) with q = 1), and the first rejected draft is replaced by
a draw from p_j with d_j removed, renormalised; when all k are kept, row k gives one more token. That
is the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) for a
deterministic draft: each emitted token is distributed exactly as p. Greedy rows keep a draft while it
equals the row's argmax, which is token for token what decoding without drafts emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamer.penalties import penalised_row
from streamer.request import Sequence
from streamer.top_k_top_p import Candidates


def can_verify(seq: Sequence) -> bool:
    """Whether a sequence may decode with drafts: its next-token rule must be the same at every
    draft position. Penalties and min_tokens change with each token kept, a grammar's mask with
    each token accepted, and beams rank whole distributions: those decode one token a step, as do
    rows asking for logprobs (reported for one token a step)."""
    p = seq.params
    return (not p.use_beam_search and seq.grammar is None and p.logprobs is None
            and not penalised_row(seq))


@dataclass
class Verified:
    accepted: list[list[int]]  # per sequence: the drafts kept, in order
    tokens: list[int]  # per sequence: the token after them (a replacement, or one more past all kept)


def settle(drafts: list[list[int]], keep: list[bool], drawn: list[int]) -> Verified:
    """Per sequence (its rows consecutive, 1 + len(drafts) of them): the drafts up to the first one
    rejected, then the token drawn at that row (or at the last row when none was rejected)."""
    accepted, tokens = [], []
    row = 0
    for draft in drafts:
        kept = 0
        while kept < len(draft) and keep[row + kept]:
            kept += 1
        accepted.append(draft[:kept])
        tokens.append(drawn[row + kept])
        row += len(draft) + 1
    return Verified(accepted, tokens)


def verify_group(group: Candidates, draft: torch.Tensor, accept_u: torch.Tensor, draw_u: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of one candidate group: whether each row's draft is kept (probability p(draft):
    `accept_u <= p`, uniforms in (0, 1]) and a token drawn from p with the draft removed (`draft`
    -1 on rows with none: the draw is then from p itself). Works on the group's candidates only:
    a draft outside them has p = 0 and is always rejected."""
    vocab_positions = (torch.arange(group.weights.shape[1], device=draft.device)[None, :]
                       if group.ids is None else group.ids)
    is_draft = vocab_positions == draft[:, None]
    weights = group.weights
    total = weights.sum(dim=-1)
    p_draft = (weights * is_draft).sum(dim=-1) / total
    keep = (accept_u <= p_draft) & (draft >= 0)
    residual = Candidates(group.rows, group.ids, weights.masked_fill(is_draft, 0.0))
    return keep, residual.draw(draw_u)
