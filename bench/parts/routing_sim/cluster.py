"""The simulated cluster: the router, the shared FIFO and the event loop (bench/routing_sim.py)."""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from bench.parts.routing_sim.sim_worker import SimWorker
from bench.parts.routing_sim.step_model import MIN_MATCH_TOKENS, StepModel
from bench.parts.routing_sim.workload import Job, Session, SessionStart, Workload
from clients.routing import WorkerView, choose, matched_tokens
from workers.worker.accounting import FLUSH_S

# --- the cluster: router, shared FIFO, events --------------------------------------------------------

class Cluster:
    def __init__(self, args: argparse.Namespace, n: int, policy: str, model: StepModel, workload: Workload) -> None:
        self.args, self.policy, self.model, self.workload = args, policy, model, workload
        self.workers = [SimWorker(f"w{i:02d}", self, args) for i in range(n)]
        self.by_name = {w.name: w for w in self.workers}
        self.shared: deque[Job] = deque()
        self.readers: dict[str, float] = {}  # workers blocked on XREADGROUP: name -> since
        self.owners: dict[str, str] = {}  # session -> worker (the session key)
        self.rng = random.Random(args.seed)
        self.events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.counter = itertools.count()
        self.jobs: list[Job] = []
        self.now = 0.0
        self.sessions_left = len(workload.starts)

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self.counter), fn, args))

    def run(self, horizon: float) -> None:
        for start in self.workload.starts:
            self.at(start.at, self.session_starts, start)
        phase = random.Random(self.args.seed + 1)
        for w in self.workers:  # heartbeats at their own phase
            self.at(phase.uniform(0, self.args.heartbeat_s), self.beat, w)
        self.at(FLUSH_S, self.flush)
        for w in self.workers:  # every worker starts blocked on its read, in order
            w.take(0.0)
        while self.sessions_left and self.events and self.events[0][0] <= horizon:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(self.now, *args)

    # --- periodic ---
    def beat(self, now: float, w: SimWorker) -> None:
        w.beat_jobs = w.shared_held
        self.at(now + self.args.heartbeat_s, self.beat, w)

    def flush(self, now: float) -> None:
        for w in self.workers:
            w.flush()
        self.at(now + FLUSH_S, self.flush)

    # --- sessions and jobs ---
    def session_starts(self, now: float, start: SessionStart) -> None:
        self.submit(now, Session(start, self.workload))

    def submit(self, now: float, session: Session) -> None:
        job = session.next_job(now)
        self.jobs.append(job)
        worker = self.route(job, now)
        if worker is None:
            self.shared.append(job)
            self.wake_reader(now)
        else:
            worker.own.append(job)
            worker.take(now)

    def answered(self, job: Job, now: float) -> None:
        session = job.session
        session.answered(job)
        if session.turn < self.args.turns:
            self.at(now + session.pause(), self.submit, session)
        else:
            self.sessions_left -= 1

    def route(self, job: Job, now: float) -> SimWorker | None:
        """The Router's decision, with the real choose() on views built as Router._views builds them:
        load = (shared-lane jobs at the worker's last load write + its own stream's length) / seats."""
        chain = job.chain
        views = [WorkerView(w.name, (w.beat_jobs + w.own_stream_length) / w.seats,
                            matched_tokens(chain, [s.digest in w.published for s in chain])) for w in self.workers]
        decision = choose(self.policy, views, self.owners.get(job.session.id), min_match_tokens=MIN_MATCH_TOKENS,
                          rng=self.rng)
        routed = decision.worker is not None
        job.outcome = decision.outcome if decision.outcome != "shared" or not routed else "routed"
        if not routed:
            return None
        worker = self.by_name[decision.worker]
        job.routed = True
        if decision.outcome in ("hit", "session"):
            job.routed_for_prefix = next(v.matched for v in views if v.name == worker.name)
        return worker

    # --- streams ---
    def next_for(self, w: SimWorker) -> Job | None:
        if w.own:
            return w.own.popleft()
        return self.shared.popleft() if self.shared else None

    def has_work_for(self, w: SimWorker) -> bool:
        return bool(w.own or self.shared)

    def set_reader(self, w: SimWorker, now: float, blocked: bool) -> None:
        if not blocked:
            self.readers.pop(w.name, None)
        else:
            self.readers.setdefault(w.name, now)

    def wake_reader(self, now: float) -> None:
        """A shared job: the worker blocked longest on its read gets it."""
        if self.readers:
            name = min(self.readers, key=self.readers.__getitem__)
            del self.readers[name]
            self.by_name[name].take(now)
