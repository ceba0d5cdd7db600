"""The beam-search requests of an engine: each one's search state (beam_search.BeamState) and
the next-token log-probabilities of beams waiting for their siblings. The scheduler's update step
consults it; it decides, the scheduler moves the sequences and their blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamer.beam_search import BeamState, Selection, step
from streamer.request import Request, Sequence
from streamer.scheduler_output import BeamResult


@dataclass
class BeamStep:
    """What one beam step decided: continue with `selection`, or (None) the search is over."""

    selection: Selection | None


class Beams:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self._states: dict[str, BeamState] = {}
        self._ready: dict[int, torch.Tensor] = {}  # seq_id -> next-token log-probs

    def add(self, request: Request, room: int) -> None:
        """Start the search of `request`; `room` is how many tokens the model allows after its prompt."""
        p = request.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        max_tokens = min(p.max_tokens or room, room)
        self._states[request.request_id] = BeamState(p.beam_width, p.length_penalty, p.early_stopping,
                                                     max_tokens, stop_ids)

    def record(self, seq: Sequence, logprobs: torch.Tensor) -> None:
        self._ready[seq.seq_id] = logprobs

    def advance(self, request: Request) -> BeamStep | None:
        """One beam step once every running beam of `request` has its log-probs (else None)."""
        beams = request.sequences
        if any(seq.seq_id not in self._ready for seq in beams):
            return None  # a sibling was preempted or not scheduled this step: wait for it
        logprobs = torch.stack([self._ready.pop(seq.seq_id) for seq in beams])
        return BeamStep(step(self._states[request.request_id], [seq.output_token_ids for seq in beams], logprobs))

    def result(self, request: Request) -> BeamResult:
        """The k best finished beams, best first; forgets the request."""
        state = self._states.pop(request.request_id)
        return BeamResult(request, [h.token_ids for h in state.finished], [h.finished_by_eos for h in state.finished])

    def drop(self, request: Request) -> None:
        """An aborted search: forget its state and waiting log-probs."""
        self._states.pop(request.request_id, None)
        for seq in request.sequences:
            self._ready.pop(seq.seq_id, None)
