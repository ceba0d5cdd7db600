"""Logit penalties: the min-tokens stop ban, repetition (HF's), presence and frequency (OpenAI's).

Each touches only the (row, token) pairs it penalises, found from flat lists of the rows' tokens:
its cost follows the tokens penalised, never the rows times the vocabulary (64 dense [row, vocab]
passes cost a third of a decode step)."""

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
    """Penalise `logits` (`[N, V]`, contiguous, one row per sequence) in place and return it."""
    _ban_stops(logits, seqs, eos_token_ids)
    _repetition(logits, seqs)
    _presence_frequency(logits, seqs)
    return logits


def _flat_index(rows: list[int], tokens: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + token for every token of every listed row: positions in the flattened logits."""
    lengths = torch.tensor([len(t) for t in tokens], device=device)
    row_index = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    return row_index * vocab + torch.tensor(list(chain.from_iterable(tokens)), dtype=torch.long, device=device)


def _ban_stops(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    """Below `min_tokens`, every token that would stop the request is held back."""
    rows, stops = [], []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            rows.append(i)
            stops.append(list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else sorted(eos_token_ids)))
    if rows:
        logits.view(-1)[_flat_index(rows, stops, logits.shape[1], logits.device)] = float("-inf")


def _repetition(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Every token seen in the prompt or the output: positive logits divided by the penalty,
    negative ones multiplied (transformers' RepetitionPenaltyLogitsProcessor)."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    seen = torch.unique(_flat_index(rows, [seqs[i].token_ids for i in rows], logits.shape[1], logits.device))
    penalty = torch.tensor([s.params.repetition_penalty for s in seqs], device=logits.device)[seen // logits.shape[1]]
    flat = logits.view(-1)
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / penalty, values * penalty)


def _presence_frequency(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's formula over the generated tokens: logit - count * frequency - (count > 0) * presence."""
    rows = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
    if not rows:
        return
    index = _flat_index(rows, [seqs[i].output_token_ids for i in rows], logits.shape[1], logits.device)
    tokens, counts = torch.unique(index, return_counts=True)
    row = tokens // logits.shape[1]
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=logits.device)[row]
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=logits.device)[row]
    logits.view(-1)[tokens] -= frequency * counts + presence
