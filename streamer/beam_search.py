"""Beam search inside the engine, following Hugging Face transformers' `generate(num_beams=k,
do_sample=False)` step for step, so the k returned beams are the same.

Each step, every running beam's next-token log-probabilities are added to its score; the best
`K = max(2, 1 + #eos) * k` candidates over all beams are kept. Candidates that end (EOS, or the
length limit) among the first k become finished hypotheses, scored `score / length**penalty`;
the best k candidates that did not end continue. Beams are sequences of the engine: a
continuation shares its parent's KV blocks (fork) and copies only the partly filled last block
on its first write, so the prompt is never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float
    finished_by_eos: bool


@dataclass
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool
    max_tokens: int
    stop_ids: set[int]
    running_scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    improvement_possible: bool = True
    done: bool = False


@dataclass
class Selection:
    """What the engine must do: continuation i extends running beam `parents[i]` by `tokens[i]`."""

    parents: list[int]
    tokens: list[int]


def step(state: BeamState, beam_tokens: list[list[int]], logprobs: torch.Tensor) -> Selection | None:
    """Advance one step. `beam_tokens[b]` are running beam b's generated tokens so far and
    `logprobs[b]` its next-token log-probabilities. Returns the next running beams, or None
    when the search is over (then `state.finished` holds the result)."""
    k = state.width
    generated = len(beam_tokens[0]) + 1
    vocab = logprobs.shape[1]
    scores = logprobs.float() + torch.tensor(state.running_scores, dtype=torch.float32)[:, None]
    keep = max(2, 1 + len(state.stop_ids)) * k
    top_scores, top_index = scores.flatten().topk(min(keep, scores.numel()))
    parents = (top_index // vocab).tolist()
    tokens = (top_index % vocab).tolist()
    at_limit = generated >= state.max_tokens
    ends = [at_limit or t in state.stop_ids for t in tokens]
    _update_finished(state, beam_tokens, top_scores.tolist(), parents, tokens, ends, generated)
    running = top_scores + torch.tensor(ends, dtype=torch.float32) * _NEG
    order = running.topk(k).indices.tolist()
    state.running_scores = [running[i].item() for i in order]
    _check_early_stop(state, generated)
    all_finished = len(state.finished) == k
    if not state.improvement_possible or (state.early_stopping and all_finished) or all(ends):
        state.done = True
        return None
    return Selection([parents[i] for i in order], [tokens[i] for i in order])


def _update_finished(state: BeamState, beam_tokens: list[list[int]], scores: list[float], parents: list[int],
                     tokens: list[int], ends: list[bool], generated: int) -> None:
    full = len(state.finished) == state.width
    if (full and state.early_stopping) or not state.improvement_possible:
        return
    for i in range(state.width):  # only the best k candidates may finish
        if i < len(tokens) and ends[i]:
            score = scores[i] / (generated ** state.length_penalty)
            by_eos = tokens[i] in state.stop_ids
            state.finished.append(Hypothesis(beam_tokens[parents[i]] + [tokens[i]], score, by_eos))
    state.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier hypotheses win ties
    del state.finished[state.width:]


def _check_early_stop(state: BeamState, generated: int) -> None:
    """transformers' heuristic (early_stopping=False): stop once the best running beam, scored
    at its current length, cannot beat the worst of k finished hypotheses."""
    if len(state.finished) < state.width:
        return
    best_possible = state.running_scores[0] / (generated ** state.length_penalty)
    if not best_possible > state.finished[-1].score:
        state.improvement_possible = False
