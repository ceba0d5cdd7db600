"""Iteration-level scheduler with vLLM V1's single rule; the owner of every request's lifecycle.

Every sequence has `num_computed_tokens`; each step hands out a token budget so that sequences catch up
with their tokens. Decodes (1 token) and prefills (many, chunked when the budget is short) of different
requests share a step; a prompt less urgent than other work takes what budget that leaves, and background
work's (batch lines) only a step without other prompts. When blocks run out, the least urgent running
sequence (the most recently admitted among equals) is preempted: its blocks are freed and it is
recomputed later. Waiting sequences more urgent than running ones that find no seat or no blocks preempt
the least urgent (never of their own or a more urgent priority) and are all admitted in that step
(preemption.py). The waiting queue orders by
priority, then by the service the request's session has already had (waiting_queue.py).

One step is `schedule() -> SchedulerOutput`, the model, then `update_from_output(...)`
(scheduler_update.py): it advances computed tokens, caches full blocks, forks samples, appends the
sampled tokens, checks the token rules of stopping and finishes sequences, through this class's
operations. Nothing else moves a sequence.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamer.beam_requests import Beams
from streamer.block_manager import BlockManager, PrefixHit
from streamer.draft_room import draft_room
from streamer.errors import QueueFullError
from streamer.outputs import PromptProgress
from streamer.preemption import priority_victims, prompt_priority, waits_for_step, yields_budget
from streamer.request import Request, SeqStatus, Sequence
from streamer.scheduler_output import ScheduledSeq, SchedulerOutput, StepUpdates
from streamer.scheduler_stats import SchedulerStats, prompt_progress
from streamer.scheduler_update import StepUpdater
from streamer.waiting_queue import AttainedService, WaitingQueue

if TYPE_CHECKING:
    from streamer.sampler import SamplerOutput
    from streamer.spec_decode.proposer import Proposer


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 4096
    max_waiting_tokens: int | None = None  # None = no bound on queued tokens
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    max_sessions: int = 4096  # sessions whose attained service is remembered (least recently served dropped)
    max_wait_rank_s: float | None = 30.0  # after this long waiting, a heavy session's call ranks as a fresh one
    num_speculative_tokens: int = 0  # drafts per decoding sequence and step, when a proposer is given
    sliding_window: int = 0  # > 0: every layer attends to this many keys; blocks before them are released
    max_loras: int = 0  # distinct adapters running at once (the runner's slots; streamer/lora)
    # Sequences of at least this priority are background work (the Batch API's lines: clients/names.py
    # BATCH_PRIORITY): their prompts run only in steps that compute no other prompt. None: no such work.
    background_priority: int | None = 2**30


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.beams = Beams(config.eos_token_ids)
        self.service = AttainedService(config.max_sessions, unit=config.block_size)
        self.waiting = WaitingQueue(self.service, config.max_wait_rank_s, clock)
        # Most urgent first, then in admission order: the last is the one to preempt when blocks run
        # short, and the urgent are given their blocks first in a step.
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerStats()
        self._forks: dict[int, list[Sequence]] = {}  # seq_id -> samples forked once its prompt is computed
        self.updater = StepUpdater(self)

    # ---- requests in -------------------------------------------------------------------------
    def check_room(self, num_seqs: int, num_tokens: int) -> None:
        """Raise QueueFullError if `num_seqs` sequences of `num_tokens` tokens would not fit."""
        c = self.config
        if len(self.waiting) + num_seqs > c.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({c.max_waiting_requests} requests)")
        if c.max_waiting_tokens is not None and self.waiting.num_tokens + num_seqs * num_tokens > c.max_waiting_tokens:
            raise QueueFullError(f"waiting queue is full ({c.max_waiting_tokens} tokens)")

    def add_request(self, request: Request, resumed: bool = False) -> None:
        """Queue a request's sequences. Samples that already diverged (`resumed`) each compute
        their own tokens (the prefix cache shares them); otherwise only the first computes the
        prompt and the others fork from it, sharing its blocks."""
        self.check_room(len(request.sequences) if resumed else 1, len(request.prompt_token_ids))
        self.requests[request.request_id] = request
        if request.params.use_beam_search:
            self.beams.add(request, self.config.max_model_len - len(request.prompt_token_ids))
        first, *rest = request.sequences
        for seq in rest if resumed else []:
            self.add(seq)
        if rest and not resumed:
            self._forks[first.seq_id] = rest
        self.add(first)

    def add(self, seq: Sequence) -> None:
        """Queue one sequence."""
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish every sequence of a request now; its blocks are free before the next step."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.beams.drop(request)
        for seq in request.sequences:
            self._forks.pop(seq.seq_id, None)
            if not seq.is_finished:
                self.finish(seq)
        self.counters.num_requests_aborted += 1
        return request

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out of the queues and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
        request = self.requests.get(seq.request_id)
        if request is not None and request.is_finished:
            del self.requests[seq.request_id]
            self.counters.num_requests_finished += 1

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.waiting.promote_aged()
        self._preempt_for_priority(out)
        num_priority_victims = len(out.preempted)
        budget, deferred = self._schedule_running(out, self.config.max_num_batched_tokens)
        if len(out.preempted) == num_priority_victims:  # else blocks ran short: nobody more this step
            for seq in sorted(deferred, key=lambda s: s.priority):  # stable: admission order among equals
                budget = self._schedule_waiting(out, budget, seq.priority)
                if waits_for_step(seq.priority, prompt_priority(out), self.config.background_priority):
                    break
                budget = self._schedule_chunk(out, seq, budget)
            budget = self._schedule_waiting(out, budget)
        if not out.scheduled:
            self._park_idle(out, budget)
        for item in out.scheduled:
            item.block_ids = self.block_manager.block_table(item.seq)
            if item.samples_next_token:
                item.forks = self._forks.pop(item.seq.seq_id, [])
        out.block_copies = self.block_manager.take_copies()
        if out.scheduled:
            self.counters.record_step(out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, list[Sequence]]:
        """Tokens for the running sequences in admission order, but for prompt chunks less urgent than other
        work, running or waiting (preemption.yields_budget): returned, to take what the more urgent
        prompts leave (a batch line's prompt never holds an interactive one back)."""
        heads = [self.waiting.peek()] if len(self.waiting) else []
        urgent = min((s.priority for s in (*self.running, *heads)), default=0)
        guesses = self._guesses(budget)
        deferred = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0 or not self._mask_ready(seq):  # a beam waiting for its siblings, or for its token mask
                i += 1
                continue
            if yields_budget(seq, urgent):
                deferred.append(seq)
                i += 1
                continue
            drafts = guesses.get(seq, [])[:budget - num_new]
            if drafts and not self.block_manager.allocate(seq, num_new + len(drafts)):
                drafts = []  # short of blocks: decode without guessing before preempting anyone
            if not drafts and not self._make_room(seq, num_new, out):
                continue  # `seq` itself was preempted: `running[i]` is the next one
            out.scheduled.append(ScheduledSeq(seq, num_new + len(drafts), spec_token_ids=drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget, deferred

    def _schedule_chunk(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        """A deferred prompt's chunk, with the budget and blocks the step has left; short of blocks it
        preempts nobody (it was never the urgent one) and waits for a later step."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if num_new <= 0 or not self.block_manager.allocate(seq, num_new):
            return budget
        out.scheduled.append(ScheduledSeq(seq, num_new))
        return budget - num_new

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate `seq`'s new tokens, preempting the least urgent, most recently admitted sequences
        while blocks are short; False when `seq` itself had to go."""
        while not self.block_manager.allocate(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _guesses(self, budget: int) -> dict[Sequence, list[int]]:
        """Guessed next tokens of the decoding sequences that may draft (draft_room.py)."""
        if self.proposer is None:
            return {}
        c = self.config
        wanted = draft_room(self.running, self._forks, budget, c.num_speculative_tokens, c.max_model_len)
        return self.proposer.propose_many(wanted) if wanted else {}

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, before: int | None = None) -> int:
        """Admit waiting sequences (more urgent than `before`; background ones only into a step without other
        prompts), in the queue's order, while seats, blocks and the budget last; returns the budget left."""
        bm = self.block_manager
        top = prompt_priority(out)
        held = []  # prompts waiting for a prefix that a running prompt is computing
        # Adapters of the running sequences: a step holds at most max_loras (one device slot each),
        # so a sequence of yet another adapter waits until one of them has no sequence running.
        adapters = {s.lora for s in self.running if s.lora is not None}
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if (before is not None and seq.priority >= before) or \
                    waits_for_step(seq.priority, top, self.config.background_priority):
                break
            if seq.lora is not None and seq.lora not in adapters and len(adapters) >= self.config.max_loras:
                held.append(self.waiting.pop_entry())
                continue
            # An embedding pools every token's hidden state, which a cached block does not hold.
            hit = bm.find_cached_prefix(seq) if seq.pooling is None else PrefixHit()
            if hit.pending or not self._mask_ready(seq):  # shared on its next step / its first mask is still filling
                held.append(self.waiting.pop_entry())
                continue
            num_new = min(seq.num_tokens - hit.num_tokens, budget)
            if not bm.allocate(seq, num_new, hit):
                break  # retried next step
            seq.num_computed_tokens = hit.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
            if bm.enable_prefix_caching:
                self.counters.prefix_cache_query_tokens += seq.num_prompt_tokens
                self.counters.prefix_cache_hit_tokens += min(hit.num_tokens, seq.num_prompt_tokens)
            self.waiting.pop()
            seq.status = SeqStatus.RUNNING
            self._join_running(seq)
            if seq.lora is not None:
                adapters.add(seq.lora)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            top = min(top, seq.priority)
        for entry in held:
            self.waiting.push_entry(entry)
        return budget

    def _mask_ready(self, seq: Sequence) -> bool:
        """Whether the next-token masks of a constrained sequence, and of the samples to be forked from it
        (they draw from its row when its prompt is done), are filled (grammar_masks.py: masks are filled
        off the step; a sequence whose mask is late waits instead of holding the step up)."""
        return all(s.grammar is None or s.grammar.ready for s in (seq, *self._forks.get(seq.seq_id, ())))

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Waiting sequences more urgent than some running ones find no seat or no blocks: preempt what
        preemption.py picks for the queue's first ones, before the running ones take this step's blocks,
        so that each is admitted this very step."""
        if not len(self.waiting):
            return
        c = self.config
        for victim in priority_victims(self.waiting.in_order(), self.running, self.block_manager, c.max_num_seqs,
                                       c.max_num_batched_tokens):
            self.running.remove(victim)
            self._preempt(victim, out)
            self.counters.num_priority_preemptions += 1

    def _park_idle(self, out: SchedulerOutput, budget: int) -> None:
        """Nothing could run: every running sequence is a beam that already has its next-token
        log-probs and waits for sibling beams that need the blocks it holds. Evict such beams
        (their log-probs are kept, so nothing is lost) until a waiting sequence fits."""
        idle = [s for s in self.running if s.num_computed_tokens == s.num_tokens]
        for seq in reversed(idle):
            self.running.remove(seq)
            self._preempt(seq, out)
            self._schedule_waiting(out, budget)
            if out.scheduled:
                return

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """`seq`, already out of the running list, gives its blocks back and is recorded in `out`."""
        out.preempted.append(seq)
        idle = seq.num_computed_tokens == seq.num_tokens  # its next token comes from elsewhere
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        if idle:
            seq.status = SeqStatus.PARKED  # no recompute until the beam step extends it
            return
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq, front=True)

    # ---- after the model ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, model_output: tuple[list[Sequence], SamplerOutput | None]
                           ) -> StepUpdates:
        """Advance the step's sequences by what the model computed and sampled (scheduler_update.py)."""
        return self.updater.apply(out, model_output)

    def start_running(self, seq: Sequence, num_computed_tokens: int) -> None:
        """A sequence forked from a running one joins the running set directly."""
        seq.num_computed_tokens = num_computed_tokens
        seq.status = SeqStatus.RUNNING
        self._join_running(seq)

    def _join_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: s.priority)  # after its equals: admission order

    # ---- introspection -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def prompt_progress(self) -> dict[str, PromptProgress]:
        return prompt_progress((*self.running, *self.waiting))

    def admission_capacity(self) -> int:
        """How many more requests can start soon: none while some already wait, and none while
        the free blocks would not even give every running sequence one more block."""
        if len(self.waiting) or self.block_manager.num_free_blocks <= len(self.running):
            return 0
        return max(0, min(self.config.max_num_seqs - len(self.running), self.config.max_waiting_requests))

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_requests": len(self.requests),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_utilization": bm.utilization(self.running),
            "num_sessions": len(self.service),
            **self.counters.as_dict(),
        }

