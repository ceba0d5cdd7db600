"""A simulated worker: the real block manager and prefix cache, seats, and steps timed by the model
(bench/routing_sim.py)."""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from bench.parts.routing_sim.step_model import StepModel
from bench.parts.routing_sim.workload import Job
from clients.routing import answer_chain
from streamer.block_manager import BlockManager
from streamer.request import Sequence
from streamer.sampling_params import SamplingParams
from workers.worker.accounting import PrefixAdvert

# --- the simulated worker ----------------------------------------------------------------------------

class FastBlocks(BlockManager):
    """The engine's block manager with a cheaper chained hash (Python's tuple hash: deterministic for
    ints, 64 bits) in place of BLAKE2b; everything else is the engine's own code."""

    def _full_block_hashes(self, seq: Sequence, known: list[Any], num_tokens: int) -> list[Any]:
        hashes, bs, ids = list(known), self.block_size, seq.token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash((hashes[-1] if hashes else 0, *ids[i * bs:(i + 1) * bs])))
        return hashes



class ClusterView(Protocol):
    """What a worker uses of its cluster (bench/parts/routing_sim/cluster.py's Cluster): the cluster
    holds its workers, so a worker knows it only by this face."""

    args: argparse.Namespace
    model: StepModel
    owners: dict[str, str]

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None: ...
    def next_for(self, w: SimWorker) -> Job | None: ...
    def has_work_for(self, w: SimWorker) -> bool: ...
    def set_reader(self, w: SimWorker, now: float, blocked: bool) -> None: ...
    def answered(self, job: Job, now: float) -> None: ...

PARAMS = SamplingParams(max_tokens=1)  # a Sequence needs some; the simulation decides lengths itself


class SimWorker:
    def __init__(self, name: str, cluster: ClusterView, args: argparse.Namespace) -> None:
        self.name, self.cluster, self.seats = name, cluster, args.max_num_seqs
        self.budget = args.max_num_batched_tokens
        self.blocks = FastBlocks(args.num_kv_blocks, args.block_size, True)
        self.advert = PrefixAdvert(lambda: args.num_kv_blocks * args.block_size)
        self.published: set[str] = set()  # the worker's prefix set in "Redis"
        self.sessions: list[str] = []  # started since the last flush
        self.own: deque[Job] = deque()  # its own request stream
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.jobs: dict[int, Job] = {}  # seq_id -> job
        self.beat_jobs = 0  # jobs held from the shared lanes at its last load write
        self.busy = False
        self.stretch: tuple[float, float, int, list[tuple[Sequence, int]]] = (0.0, 0.0, 0, [])
        self.version = 0  # of the pending step-end event (older ones are ignored)

    @property
    def held(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def shared_held(self) -> int:
        """What the worker writes into `Names.loads`: jobs held from the shared lanes."""
        return sum(1 for job in self.jobs.values() if not job.routed)

    @property
    def own_stream_length(self) -> int:
        """XLEN of its own stream: routed jobs not finished (unread, or read and running)."""
        return len(self.own) + sum(1 for job in self.jobs.values() if job.routed)

    def capacity(self) -> int:
        """The engine's admission_capacity (jobs taken but not admitted are in `waiting`)."""
        if self.waiting or self.blocks.num_free_blocks <= len(self.running):
            return 0
        return max(0, self.seats - len(self.running))

    # --- intake ---
    def take(self, now: float) -> None:
        """Read as capacity allows: own stream first, then the shared FIFO; block when nothing's there."""
        count = self.capacity()
        taken = 0
        while taken < count and (job := self.cluster.next_for(self)) is not None:
            self.start(job, now)
            taken += 1
        self.cluster.set_reader(self, now, blocked=count > taken)
        if taken:
            self.wake(now)

    def start(self, job: Job, now: float) -> None:
        seq = Sequence(request_id=job.id, index=0, token_ids=list(job.prompt_ids),
                       num_prompt_tokens=len(job.prompt_ids), params=PARAMS, session=job.session.id)
        self.jobs[seq.seq_id] = job
        self.waiting.append(seq)
        self.advert.add(job.chain)  # Accounting.started: prefix_chain(the job)
        self.sessions.append(job.session.id)

    def flush(self) -> None:
        """Accounting's flush: the prefix set's changes and the sessions started go to Redis."""
        self.published |= self.advert.added
        self.published -= self.advert.removed
        self.advert.added, self.advert.removed = set(), set()
        for session in self.sessions:
            self.cluster.owners[session] = self.name
        self.sessions.clear()

    # --- engine steps ---
    def wake(self, now: float) -> None:
        """Work arrived: step now if idle, else end a run of decode steps after the step under way."""
        if not self.busy:
            self.begin_step(now)
            return
        t0, dt, k, scheduled = self.stretch
        done = int((now - t0) / dt) + 1 if dt > 0 else k
        if done < k:
            self.stretch = (t0, dt, done, scheduled)
            self.version += 1
            self.cluster.at(t0 + done * dt, self.end_step, self.version)

    def begin_step(self, now: float) -> None:
        scheduled = self.schedule()
        if not scheduled:
            self.busy = False
            return
        k = self.decode_run(scheduled)
        dt = self.cluster.model.seconds(sum(n for _, n in scheduled))
        self.busy, self.stretch = True, (now, dt, k, scheduled)
        self.version += 1
        self.cluster.at(now + k * dt, self.end_step, self.version)
        self.take(now)  # admitted prompts left the waiting queue: the intake may read again

    def decode_run(self, scheduled: list[tuple[Sequence, int]]) -> int:
        """How many identical decode steps can run as one event: until the first sequence finishes,
        while nothing waits to be admitted or read (an arrival cuts it short: `wake`)."""
        if self.waiting or any(n != 1 or s.num_computed_tokens < s.num_prompt_tokens for s, n in scheduled):
            return 1
        if self.capacity() and self.cluster.has_work_for(self):
            return 1
        k = min(self.cluster.args.answer_tokens - s.num_output_tokens for s, _ in scheduled)
        if k <= 1 or not all(self.blocks.allocate(s, k) for s, _ in scheduled):
            return 1
        return k

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The engine scheduler's order: running sequences (preempting the newest when blocks run out),
        then, if nothing was preempted, waiting prompts while budget, seats and blocks last."""
        budget, scheduled, preempted = self.budget, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, n):
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        if not preempted:
            budget = self.admit(scheduled, budget)
        return scheduled

    def admit(self, scheduled: list[tuple[Sequence, int]], budget: int) -> int:
        held = []  # prompts waiting one step for blocks a running prompt is computing
        while self.waiting and budget > 0 and len(self.running) < self.seats:
            seq = self.waiting[0]
            hit = self.blocks.find_cached_prefix(seq)
            if hit.pending:
                held.append(self.waiting.popleft())
                continue
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.blocks.allocate(seq, n, hit):
                break
            seq.num_computed_tokens = hit.num_tokens
            job = self.jobs[seq.seq_id]
            if job.cached < 0:  # a preempted job's recompute is not a hit
                job.cached = min(hit.num_tokens, seq.num_prompt_tokens)
            self.running.append(self.waiting.popleft())
            scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        return budget

    def preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def end_step(self, now: float, version: int) -> None:
        if version != self.version:
            return
        _, _, k, scheduled = self.stretch
        for seq, n in scheduled:
            self.advance(seq, n, k, now)
        self.busy = False
        self.take(now)
        if not self.busy:
            self.begin_step(now)

    def advance(self, seq: Sequence, n: int, k: int, now: float) -> None:
        """A step computed `n` tokens of `seq` (a prompt chunk or a decode), or `k` decode steps ran."""
        job = self.jobs[seq.seq_id]
        if k > 1:  # each step computed the last token and sampled the next
            seq.num_computed_tokens += k
            self.sample(seq, job, k)
        else:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:  # caught up: the next token comes out
                job.first = min(job.first, now)
                self.sample(seq, job, 1)
        self.blocks.cache_full_blocks(seq)
        if seq.num_output_tokens >= self.cluster.args.answer_tokens:
            self.finish(seq, job, now)

    @staticmethod
    def sample(seq: Sequence, job: Job, count: int) -> None:
        """The answer's words are what the model generates (the template around them is not)."""
        words = job.answer.ids[2:-2]
        seq.token_ids.extend(words[seq.num_output_tokens:seq.num_output_tokens + count])

    def finish(self, seq: Sequence, job: Job, now: float) -> None:
        job.done = now
        self.running.remove(seq)
        self.blocks.free(seq)
        del self.jobs[seq.seq_id]
        self.advert.add(answer_chain(job.as_dict, job.answer.text))  # Accounting.finished
        self.cluster.answered(job, now)
