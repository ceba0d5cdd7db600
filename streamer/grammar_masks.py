"""Filling next-token masks off the engine's step, within a time budget per mask and per request.

A mask is filled on a mask thread as soon as the token before it is accepted, and the next step waits
a little (`settle`) for the masks that come fast. A sequence whose mask is still not ready is not
scheduled (the scheduler asks `GrammarState.ready`): the step goes on without it, and no other request
waits for its grammar more than that little.

Masks come in two lanes, each with its thread. A state whose last fill took under FAST_S of CPU is
filled in the fast lane, at the engine's priority; the others, in the slow lane, at a lower one, so
an ambiguous grammar (xgrammar's Earley parser: seconds per mask for some, and a fill cannot be
interrupted) takes the CPU the steps leave. A fast-lane fill that runs long is moved to the slow lane
while it runs (its thread reniced, a fresh fast thread started). Each fill's CPU time is measured
against `mask_s`, and the sum over a request's sequences against `request_s`; past either, the request
is failed (the engine takes `take_failures()` before each step) and the thread still inside that fill
is abandoned at the lowest priority.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

FAST_S = 0.001  # a state whose last fill took less CPU than this is filled in the fast lane, and waited for
SETTLE_S = 0.005  # the longest a step waits for fast fills (a long queue of them, or one turned slow)
SLOW_NICE = 19  # the slow lane's priority: a slow grammar gets only the CPU the steps leave
MAX_ABANDONED = 4  # threads left inside an over-budget fill at once; past it their lane waits for them
FAST, SLOW = "fast", "slow"


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
        self._queues: dict[str, queue.SimpleQueue[Fillable]] = {FAST: queue.SimpleQueue(), SLOW: queue.SimpleQueue()}
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._lanes: dict[int, str] = {}  # thread ident -> the lane it serves (threads left inside a fill: none)
        # thread ident -> (its state, its CPU clock, the clock when the fill began, its native id)
        self._running: dict[int, tuple[Fillable, int | None, float, int]] = {}
        self._abandoned: set[int] = set()
        self._failures: dict[str, str] = {}
        self._awaited: set[Fillable] = set()  # fast fills the next schedule waits for

    def submit(self, state: Fillable) -> None:
        lane = FAST if state.last_fill_s < FAST_S else SLOW
        with self._lock:
            if lane == FAST:
                self._awaited.add(state)
            if lane not in self._lanes.values():
                self._start_thread(lane)
        self._queues[lane].put(state)

    def settle(self) -> None:
        """Wait (SETTLE_S at most) for the fast fills: without it a sequence would miss the step after
        each of its tokens (its fill queued behind the step's own Python). A fill that turns out slow
        is moved to the slow lane, and not waited for."""
        with self._settled:
            if self._awaited and not self._settled.wait_for(lambda: not self._awaited, SETTLE_S):
                for ident, (state, clock, start, native) in list(self._running.items()):
                    if self._lanes.get(ident) == FAST and _cpu_seconds(clock) - start >= FAST_S:
                        self._awaited.discard(state)
                        self._lanes[ident] = SLOW
                        _set_priority(native, SLOW_NICE)
                        self._start_thread(FAST)

    def take_failures(self) -> dict[str, str]:
        """Requests over a budget since the last call (request id -> why); also catches fills that
        are still running past theirs."""
        with self._lock:
            for ident, (state, clock, start, native) in list(self._running.items()):
                if ident not in self._abandoned and self._charge(state.budget, _cpu_seconds(clock) - start,
                                                                 running=True):
                    self._abandon(ident, state, native)
            failures, self._failures = self._failures, {}
        return failures

    def wait(self, timeout_s: float) -> None:
        """Until a fill finishes or `timeout_s` passes: how an engine with only masks to wait for idles."""
        self.filled.wait(timeout_s)
        self.filled.clear()

    def _start_thread(self, lane: str) -> None:
        thread = threading.Thread(target=self._run, args=(lane,), name=f"streamer-grammar-{lane}", daemon=True)
        thread.start()
        self._lanes[thread.ident] = lane  # type: ignore[index]

    def _run(self, lane: str) -> None:
        me = threading.get_ident()
        clock, native = _thread_clock(me), threading.get_native_id()
        if lane == SLOW:
            _set_priority(native, SLOW_NICE)
        while True:
            with self._lock:
                lane = self._lanes.get(me, lane)
                if list(self._lanes.values()).count(lane) > 1:  # a moved thread, and its lane has one
                    del self._lanes[me]
                    return
            state = self._queues[lane].get()
            if state.budget.failure is None:
                self._fill(me, clock, native, state)
            with self._lock:
                self._awaited.discard(state)
                if not self._awaited:
                    self._settled.notify_all()
                if me in self._abandoned:  # a fresh thread took this one's place
                    self._abandoned.discard(me)
                    return
            self.filled.set()

    def _fill(self, me: int, clock: int | None, native: int, state: Fillable) -> None:
        start = _cpu_seconds(clock)
        with self._lock:
            self._running[me] = (state, clock, start, native)
        state.fill()
        state.last_fill_s = used = _cpu_seconds(clock) - start
        with self._lock:
            del self._running[me]
            if me not in self._abandoned:
                self._charge(state.budget, used)

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

    def _abandon(self, ident: int, state: Fillable, native: int) -> None:
        """Leave the thread inside its fill (it cannot be interrupted) at the lowest priority, and let a
        fresh thread serve its lane while no more than MAX_ABANDONED are left so."""
        if len(self._abandoned) >= MAX_ABANDONED:
            return
        self._abandoned.add(ident)
        self._awaited.discard(state)
        lane = self._lanes.pop(ident, SLOW)
        _set_priority(native, 19)
        if lane not in self._lanes.values():
            self._start_thread(lane)


def _set_priority(native_thread_id: int, nice: int) -> None:
    with contextlib.suppress(OSError):  # on Linux, the priority of that one thread; elsewhere it stays
        os.setpriority(os.PRIO_PROCESS, native_thread_id, nice)


def _thread_clock(ident: int) -> int | None:
    """The CPU clock of a thread (Linux and most Unixes); None where there is none (macOS)."""
    getter = getattr(time, "pthread_getcpuclockid", None)
    return None if getter is None else getter(ident)


def _cpu_seconds(clock: int | None) -> float:
    """A thread's CPU time; without a per-thread clock, wall time stands in (budgets then count waits too)."""
    return time.monotonic() if clock is None else time.clock_gettime(clock)
