"""Logit penalties: the min-tokens stop ban, repetition (HF's), presence and frequency (OpenAI's).

Each is one indexed write over the rows that ask for it, built from flat (row, token) lists, so
the cost follows the tokens penalised, not the number of rows."""

from __future__ import annotations

from itertools import chain

import torch

from streamer.request import Sequence


def penalised_row(seq: Sequence) -> bool:
    """Whether `apply_penalties` changes this sequence's row."""
    p = seq.params
    return (seq.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0 or bool(p.presence_penalty)
            or bool(p.frequency_penalty))


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
    """Penalise `logits` (`[N, V]`, one row per sequence) in place and return it."""
    _ban_stops(logits, seqs, eos_token_ids)
    _repetition(logits, seqs)
    _presence_frequency(logits, seqs)
    return logits


def _flat(rows: list[int], tokens: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors for every token of every listed row."""
    lengths = torch.tensor([len(t) for t in tokens], device=device)
    row_index = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    return row_index, torch.tensor(list(chain.from_iterable(tokens)), dtype=torch.long, device=device)


def _ban_stops(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    """Below `min_tokens`, every token that would stop the request is held back."""
    rows, stops = [], []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            rows.append(i)
            stops.append(list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else sorted(eos_token_ids)))
    if rows:
        logits[_flat(rows, stops, logits.device)] = float("-inf")


def _repetition(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Every token seen in the prompt or the output: positive logits divided by the penalty,
    negative ones multiplied (transformers' RepetitionPenaltyLogitsProcessor)."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    local, tokens = _flat(list(range(len(rows))), [seqs[i].token_ids for i in rows], logits.device)
    seen[local, tokens] = True
    penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rows], device=logits.device)[:, None]
    index = torch.tensor(rows, device=logits.device)
    values = logits[index]
    logits[index] = torch.where(seen, torch.where(values > 0, values / penalty, values * penalty), values)


def _presence_frequency(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's formula over the generated tokens: logit - count * frequency - (count > 0) * presence."""
    rows = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
    if not rows:
        return
    counts = torch.zeros(len(rows), logits.shape[1], device=logits.device)
    local, tokens = _flat(list(range(len(rows))), [seqs[i].output_token_ids for i in rows], logits.device)
    counts.index_put_((local, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    params = [seqs[i].params for i in rows]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
    index = torch.tensor(rows, device=logits.device)
    logits[index] -= frequency * counts + presence * (counts > 0).float()
