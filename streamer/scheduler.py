"""Iteration-level scheduler with vLLM V1's single rule.

Every sequence has `num_computed_tokens`; each step hands out a token budget so that sequences
catch up with their tokens. Decodes (1 token) and prefills (many, chunked when the budget is
short) of different requests share a step. When blocks run out, the most recently admitted
running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from streamer.block_manager import BlockManager
from streamer.errors import QueueFullError
from streamer.request import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    forks: list[Sequence] = field(default_factory=list)  # siblings that sample from this row

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class WaitingQueue:
    """FCFS, or by (priority, arrival) when priorities are used; lower priority value runs first.
    Preempted sequences go back ahead of everything of their priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Sequence]] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)

    def push(self, seq: Sequence, front: bool = False) -> None:
        order = next(self._front) if front else next(self._order)
        heapq.heappush(self._heap, (seq.priority, order, seq.seq_id, seq))

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> bool:
        for i, item in enumerate(self._heap):
            if item[3] is seq:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (item[3] for item in self._heap)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_waiting_requests: int, max_waiting_tokens: int | None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.num_waiting_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0

    def check_room(self, num_seqs: int, num_tokens: int) -> None:
        """Raise QueueFullError if `num_seqs` sequences of `num_tokens` tokens would not fit."""
        if len(self.waiting) + num_seqs > self.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting_requests} requests)")
        if self.max_waiting_tokens is not None and \
                self.num_waiting_tokens + num_seqs * num_tokens > self.max_waiting_tokens:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting_tokens} tokens)")

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)
        self.num_waiting_tokens += seq.num_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if not out.scheduled:
            self._park_idle(out, budget)
        for item in out.scheduled:
            if item.samples and item.seq.pending_forks:
                item.forks = item.seq.pending_forks
        out.block_copies = self.block_manager.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # a beam whose next token waits for its sibling beams
                i += 1
                continue
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            cached = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, num_new):
                self.block_manager.free(seq)  # give the prefix hits back; retried next step
                seq.num_computed_tokens = 0
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            if self.block_manager.enable_prefix_caching:
                self.prefix_cache_query_tokens += seq.num_prompt_tokens
                self.prefix_cache_hit_tokens += min(cached, seq.num_prompt_tokens)
            self.waiting.pop()
            self.num_waiting_tokens -= seq.num_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _park_idle(self, out: SchedulerOutput, budget: int) -> None:
        """Nothing could run: every running sequence is a beam that already has its next-token
        log-probs and waits for sibling beams that need the blocks it holds. Evict such beams
        (their log-probs are kept, so nothing is lost) until a waiting sequence fits."""
        idle = [s for s in self.running if s.num_computed_tokens == s.num_tokens]
        for seq in reversed(idle):
            self.running.remove(seq)
            self._preempt(seq)
            out.preempted.append(seq)
            self._schedule_waiting(out, budget)
            if out.scheduled:
                return

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.beam_logprobs is not None:
            return  # parked: a beam needs no recompute until the beam step picks it again
        self.waiting.push(seq, front=True)
        self.num_waiting_tokens += seq.num_tokens

    def start_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the running set directly."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out of the queues and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and self.waiting.remove(seq):
            self.num_waiting_tokens -= seq.num_tokens
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
