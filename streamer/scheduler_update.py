"""The scheduler's update step: what the model computed and sampled in one step, applied to the step's
sequences.

It advances each scheduled sequence's computed tokens, caches its full blocks, forks the samples that
start from a computed prompt, folds embedding chunks into their pools, appends the sampled tokens (kept
drafts first) through the token rules of stopping, and moves beam searches on by one step. Sequences
join, leave or queue only through the scheduler's own operations (`start_running`, `finish`, `add`), so
the scheduler stays the one owner of every sequence's lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from streamer.beam_requests import Beams
from streamer.beam_search import Selection
from streamer.block_manager import BlockManager
from streamer.request import Request, SeqStatus, Sequence
from streamer.scheduler_output import PooledResult, ScheduledSeq, SchedulerOutput, SeqUpdate, StepUpdates
from streamer.scheduler_stats import SchedulerStats
from streamer.stop_checker import finish_reason_after
from streamer.waiting_queue import AttainedService

if TYPE_CHECKING:
    from streamer.sampler import SamplerOutput


class _Limits(Protocol):
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def sliding_window(self) -> int: ...


class SequenceOwner(Protocol):
    """What the update step uses of the scheduler (scheduler.py): its parts, and its operations that
    move sequences."""

    @property
    def config(self) -> _Limits: ...
    @property
    def block_manager(self) -> BlockManager: ...
    @property
    def service(self) -> AttainedService: ...
    @property
    def counters(self) -> SchedulerStats: ...
    @property
    def beams(self) -> Beams: ...
    @property
    def requests(self) -> dict[str, Request]: ...
    def start_running(self, seq: Sequence, num_computed_tokens: int) -> None: ...
    def finish(self, seq: Sequence) -> None: ...
    def add(self, seq: Sequence) -> None: ...


class StepUpdater:
    def __init__(self, scheduler: SequenceOwner) -> None:
        self.s = scheduler

    def apply(self, out: SchedulerOutput, model_output: tuple[list[Sequence], SamplerOutput | None]) -> StepUpdates:
        """Advance the step's sequences by what the model computed and sampled."""
        s = self.s
        drafted: dict[int, int] = {}
        sampled, result = model_output
        core = StepUpdates()
        for item in out.scheduled:
            if item.seq.pooling is not None:
                self._pool(item, result, core)
                continue
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)  # drafts: if kept
            if item.spec_token_ids:
                drafted[item.seq.seq_id] = len(item.spec_token_ids)
            s.service.add(item.seq.session, item.num_new_tokens)
            s.block_manager.cache_full_blocks(item.seq)
            if s.config.sliding_window:
                s.block_manager.release_outside_window(item.seq, s.config.sliding_window)
            for child in item.forks:  # parallel samples start from the computed prompt's blocks
                s.block_manager.fork(item.seq, child)
                s.start_running(child, item.seq.num_computed_tokens)
        beam_requests: dict[str, Request] = {}
        for i, seq in enumerate(sampled):
            assert result is not None
            if seq.params.use_beam_search:
                s.beams.record(seq, result.beam_logprobs[i])
                beam_requests[seq.request_id] = s.requests[seq.request_id]
            elif seq.seq_id in drafted:
                core.updates += self._append_drafted(seq, result.accepted[i], result.token_ids[i])  # type: ignore[index]
                s.counters.record_drafts(drafted[seq.seq_id], len(result.accepted[i]))  # type: ignore[index]
            else:
                core.updates.append(self._append_token(seq, result.token_ids[i], result.logprobs[i]))
        for request in beam_requests.values():
            self._step_beams(request, core)
        return core

    def _pool(self, item: ScheduledSeq, result: SamplerOutput | None, core: StepUpdates) -> None:
        """An embedding's chunk ran: fold its rows into its pool; after the prompt's last chunk its
        embedding is done and its blocks are freed at once (prefill only: no KV kept, none cached)."""
        seq = item.seq
        assert seq.pooling is not None
        partial = result.pooled.get(seq.seq_id) if result is not None else None
        seq.pooling.add(seq.num_computed_tokens, partial, item.num_new_tokens)
        seq.num_computed_tokens += item.num_new_tokens
        self.s.service.add(seq.session, item.num_new_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            core.pooled.append(PooledResult(seq, seq.pooling.result()))
            self.s.finish(seq)

    def _append_drafted(self, seq: Sequence, accepted: list[int], token: int) -> list[SeqUpdate]:
        """The kept drafts (their K/V already computed by the verification), then the token after
        them, each through the token rules of stopping: the first that ends the sequence ends it."""
        updates = []
        for t in accepted:
            updates.append(self._append_token(seq, t, None))
            if seq.is_finished:
                return updates
            seq.num_computed_tokens += 1
        if accepted:
            self.s.block_manager.cache_full_blocks(seq)
        updates.append(self._append_token(seq, token, None))
        return updates

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> SeqUpdate:
        config = self.s.config
        seq.token_ids.append(token)
        self.s.counters.generation_tokens += 1
        update = SeqUpdate(seq, token, logprobs)
        reason = finish_reason_after(seq, token, None, config.eos_token_ids, config.max_model_len)
        if seq.grammar is not None and seq.grammar.accept(token) and seq.grammar.terminated and reason is None:
            reason = "stop", None  # the output is complete: its grammar allows nothing more
        if reason is not None:
            update.finish_reason, update.stop_reason = reason
            self.s.finish(seq)
        return update

    def _step_beams(self, request: Request, core: StepUpdates) -> None:
        step = self.s.beams.advance(request)
        if step is None:
            return
        if step.selection is None:
            core.beam_results.append(self.s.beams.result(request))
            for seq in request.sequences:
                self.s.finish(seq)
            return
        request.sequences = self._continue_beams(request.sequences, step.selection)

    def _continue_beams(self, beams: list[Sequence], selection: Selection) -> list[Sequence]:
        """The first continuation of a parent reuses its sequence; further ones fork it (shared
        KV blocks, copy-on-write). Beams that no continuation extends are finished."""
        used: set[int] = set()
        children: list[Sequence] = []
        for parent_index in selection.parents:
            parent = beams[parent_index]
            if parent_index in used:
                children.append(self._fork_beam(parent))
            else:
                used.add(parent_index)
                children.append(parent)
        for i, seq in enumerate(beams):
            if i not in used:
                self.s.finish(seq)
        for index, (child, token) in enumerate(zip(children, selection.tokens)):
            child.token_ids.append(token)
            child.index = index
            if child.status is not SeqStatus.RUNNING:  # parked, or forked from a parked parent
                self.s.add(child)
        return children

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = parent.sibling()
        if parent.status is SeqStatus.RUNNING:
            self.s.block_manager.fork(parent, child)
            self.s.start_running(child, parent.num_computed_tokens)
        # else the parent was parked: the child recomputes (the prefix cache shares its blocks)
        return child
