"""Beam-search requests in the engine: when every running beam of a request has its
next-token log-probabilities, pick the next beams (beam_search.step) and make them real
sequences by forking parents (shared KV blocks, copy-on-write) and dropping the rest."""

from __future__ import annotations

from typing import Any

from streamer.beam_search import BeamState, Selection, step
from streamer.block_manager import BlockManager
from streamer.outputs import CompletionOutput, RequestOutput
from streamer.request import Request, SeqStatus, Sequence
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler


def new_beam_state(params: SamplingParams, eos_token_ids: set[int], room: int) -> BeamState:
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    max_tokens = min(params.max_tokens or room, room)
    return BeamState(params.beam_width, params.length_penalty, params.early_stopping, max_tokens, stop_ids)


def advance_beams(request: Request, block_manager: BlockManager, scheduler: Scheduler) -> bool:
    """Run one beam step if all running beams are ready; True when the search has finished."""
    beams = request.sequences
    if any(seq.beam_logprobs is None for seq in beams):
        return False  # a sibling was preempted or not scheduled this step: wait for it
    import torch

    logprobs = torch.stack([seq.beam_logprobs for seq in beams])
    for seq in beams:
        seq.beam_logprobs = None
    selection = step(request.beam, [seq.output_token_ids for seq in beams], logprobs)
    if selection is None:
        for seq in beams:
            scheduler.finish(seq)
        return True
    request.sequences = _continue(beams, selection, block_manager, scheduler)
    return False


def _continue(beams: list[Sequence], selection: Selection, block_manager: BlockManager,
              scheduler: Scheduler) -> list[Sequence]:
    """The first continuation of a parent reuses its sequence; further ones fork it."""
    used: set[int] = set()
    children: list[Sequence] = []
    for parent_index in selection.parents:
        parent = beams[parent_index]
        if parent_index in used:
            child = _fork(parent, block_manager, scheduler)
        else:
            used.add(parent_index)
            child = parent
        children.append(child)
    for i, seq in enumerate(beams):
        if i not in used:
            scheduler.finish(seq)
    for child, token in zip(children, selection.tokens):
        child.token_ids.append(token)
    for index, child in enumerate(children):
        child.index = index
        if child.status is not SeqStatus.RUNNING:  # parked or forked from a parked parent
            scheduler.add(child)
    return children


def _fork(parent: Sequence, block_manager: BlockManager, scheduler: Scheduler) -> Sequence:
    child = Sequence(request_id=parent.request_id, index=parent.index, token_ids=list(parent.token_ids),
                     num_prompt_tokens=parent.num_prompt_tokens, params=parent.params,
                     detokenizer=parent.detokenizer, priority=parent.priority)
    if parent.status is SeqStatus.RUNNING:
        block_manager.fork(parent, child)
        scheduler.start_running(child)
    # else the parent was parked: the child recomputes (the prefix cache shares its blocks)
    return child


def beam_output(request: Request, tokenizer: Any) -> RequestOutput:
    """The k best finished beams, best first."""
    outputs = [
        CompletionOutput(index=i, token_ids=h.token_ids,
                         text=tokenizer.decode(h.token_ids, skip_special_tokens=request.params.skip_special_tokens),
                         finish_reason="stop" if h.finished_by_eos else "length")
        for i, h in enumerate(request.beam.finished)
    ]
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished=True,
                         prompt=request.prompt)
