"""Filling next-token masks off the engine's step, within a time budget per mask and per request.

A mask is filled on a thread of its own as soon as the token before it is accepted, and the next
step waits a little (`settle`) for the masks that come fast. A sequence whose mask is still not ready
is not scheduled (the scheduler asks `GrammarState.ready`): the step goes on without it, and no other
request waits for its grammar more than that little. An ambiguous grammar can take seconds per mask (xgrammar's Earley parser,
which cannot be interrupted), so each fill's CPU time is measured against `mask_s`, and the sum
over a request's sequences against `request_s`; past either, the request is failed (the engine
takes `take_failures()` before each step) and the thread still inside that fill is abandoned at
the lowest CPU priority while a fresh one takes the queue.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

THREADS = 1  # fills take microseconds: one thread keeps up with a full batch of constrained sequences
FAST_S = 0.001  # a state whose last fill took less CPU than this is waited for before the next schedule
SETTLE_S = 0.005  # the longest a step waits for such fills (a long queue of them, or one turned slow)
MAX_ABANDONED = 4  # threads left inside an over-budget fill at once; past it the queue waits for them


@dataclass(frozen=True)
class Budgets:
    """CPU seconds of grammar work allowed: one mask (its accepted token included), and all of one
    request's masks together."""

    mask_s: float
    request_s: float


class RequestBudget:
    """The grammar CPU time one request has used (its sequences share it) and why it failed."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.used_s = 0.0
        self.failure: str | None = None


class Fillable(Protocol):
    budget: RequestBudget
    last_fill_s: float  # CPU time of its last fill (0 before the first)

    def fill(self) -> None: ...


class MaskFiller:
    """Runs each submitted state's `fill()` on the mask threads and keeps to the budgets."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets
        self.filled = threading.Event()  # set after each fill: what an idle engine waits on
        self._queue: queue.SimpleQueue[Fillable] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # thread ident -> (its state, its CPU clock, the clock when the fill began, its native id)
        self._running: dict[int, tuple[Fillable, int, float, int]] = {}
        self._live = 0
        self._abandoned: set[int] = set()
        self._failures: dict[str, str] = {}
        self._settled = threading.Condition(self._lock)
        self._awaited: set[Fillable] = set()  # submitted fills the next schedule waits for (fast ones)

    def submit(self, state: Fillable) -> None:
        with self._lock:
            if state.last_fill_s < FAST_S:
                self._awaited.add(state)
            if self._live < THREADS:
                self._start_thread()
        self._queue.put(state)

    def settle(self) -> None:
        """Wait (SETTLE_S at most) for the fills of states whose masks come fast: without it a sequence
        would miss the step after each of its tokens (its fill is queued behind the step's own Python).
        A state whose fill runs longer is not waited for again: its sequence waits, not the step."""
        with self._settled:
            if self._awaited and not self._settled.wait_for(lambda: not self._awaited, SETTLE_S):
                slow = {state for state, clock, start, _ in self._running.values()
                        if time.clock_gettime(clock) - start >= FAST_S}
                self._awaited -= slow

    def take_failures(self) -> dict[str, str]:
        """Requests over a budget since the last call (request id -> why); also catches fills that
        are still running past theirs."""
        self._check_running()
        with self._lock:
            failures, self._failures = self._failures, {}
        return failures

    def wait(self, timeout_s: float) -> None:
        """Until a fill finishes or `timeout_s` passes: how an engine with only masks to wait for idles."""
        self.filled.wait(timeout_s)
        self.filled.clear()

    def _start_thread(self) -> None:
        self._live += 1
        threading.Thread(target=self._run, name="streamer-grammar-masks", daemon=True).start()

    def _run(self) -> None:
        me = threading.get_ident()
        clock, native = time.pthread_getcpuclockid(me), threading.get_native_id()
        while True:
            state = self._queue.get()
            if state.budget.failure is not None:
                self._done(state)
                continue
            start = time.clock_gettime(clock)
            with self._lock:
                self._running[me] = (state, clock, start, native)
            state.fill()
            state.last_fill_s = used = time.clock_gettime(clock) - start
            with self._lock:
                del self._running[me]
                abandoned = me in self._abandoned
                self._abandoned.discard(me)
                if not abandoned:
                    self._charge(state.budget, used)
            self._done(state)
            if abandoned:  # a fresh thread took this one's place
                return

    def _done(self, state: Fillable) -> None:
        with self._lock:
            self._awaited.discard(state)
            if not self._awaited:
                self._settled.notify_all()
        self.filled.set()

    def _check_running(self) -> None:
        with self._lock:
            for ident, (state, clock, start, native) in list(self._running.items()):
                if ident in self._abandoned:
                    continue
                if self._charge(state.budget, time.clock_gettime(clock) - start, running=True):
                    self._abandon(ident, native)

    def _charge(self, budget: RequestBudget, used: float, running: bool = False) -> bool:
        """Count `used` against the budgets (a running fill's time so far is only compared); True when
        the request is over one now."""
        b = self.budgets
        total = budget.used_s + used
        if not running:
            budget.used_s = total
        if budget.failure is not None:
            return True
        if used > b.mask_s:
            budget.failure = (f"structured_outputs: a token mask took over the budget of {b.mask_s:g} s of CPU "
                              "(grammar_mask_budget_s): the grammar is too ambiguous to follow")
        elif total > b.request_s:
            budget.failure = (f"structured_outputs: the request's token masks took over the budget of "
                              f"{b.request_s:g} s of CPU (grammar_request_budget_s)")
        else:
            return False
        self._failures[budget.request_id] = budget.failure
        return True

    def _abandon(self, ident: int, native: int) -> None:
        """Leave the thread inside its fill (it cannot be interrupted) at the lowest priority, and let a
        fresh thread serve the queue while no more than MAX_ABANDONED are left so."""
        if len(self._abandoned) >= MAX_ABANDONED:
            return
        self._abandoned.add(ident)
        self._awaited.discard(self._running[ident][0])
        self._live -= 1
        _set_priority(native, 19)
        self._start_thread()


def _set_priority(native_thread_id: int, nice: int) -> None:
    with contextlib.suppress(OSError):  # on Linux, the priority of that one thread; elsewhere it stays
        os.setpriority(os.PRIO_PROCESS, native_thread_id, nice)
