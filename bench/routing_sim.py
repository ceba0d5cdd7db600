"""Multi-worker routing, simulated: 16-64 workers driven by the real routing code, to see what each
policy does at a scale this machine cannot run for real (bench/routing.py runs 3 real workers).

    python -m bench.routing_sim [--workers 16,32,64] [--policies cache_load,cache,least_loaded,random,shared]
                                [--load 0.7] [--sessions-per-worker 36] [--zipf 0] [--heartbeat-s 0.25]

What is real and what is modelled:

- Routing is the real code: every job's chain is `clients.routing.prefix_chain` of its messages, and
  `clients.routing.choose` decides, on `WorkerView`s built as `Router` builds them: load = (the jobs a
  worker held from the shared lanes at its last load write, every --heartbeat-s, by default its
  accounting flush of 0.25 s, + its own stream's length, read fresh) / its seats; matched =
  `clients.routing.matched_tokens` against the digests the
  worker's `workers.worker.accounting.PrefixAdvert` had flushed to "Redis" (every FLUSH_S, its added and
  removed sets, as `Accounting` sends them). The advert is fed as the worker feeds it: the job's
  `prefix_chain` when it starts, its `answer_chain` when it finishes; a session's owner is written at
  the same flush. Jobs that `choose` sends nowhere wait in one shared FIFO; a worker with a free seat
  reads its own stream first, then the FIFO, and the one that has waited longest for work gets the
  next shared job (what XREADGROUP does for blocked readers).
- Each worker's KV cache is `streamer.block_manager.BlockManager` (the engine's: full-block chained
  hashes, LRU of free blocks, later blocks of a sequence evicted first, promises of blocks a running
  prompt computes), behind a small copy of the engine scheduler's step: running sequences first
  (decodes, prompt chunks, preempting the newest when blocks run out), then waiting prompts in FIFO
  order within --max-num-batched-tokens. A job's cached tokens are the BlockManager's prefix hit.
  Block hashes use Python's tuple hash instead of BLAKE2b (the same chains, cheaper).
- Time: one engine step takes a + b x tokens scheduled, fitted at startup on streamer's LLMEngine
  running the tiny random checkpoint of bench/routing.py (decode batches and prompt chunks of several
  sizes; the points and the fit are printed; --step-model A,B skips the measurement). A run of
  identical decode steps is one event, cut short when a job arrives for that worker.
- Tokens: the words of the synthetic text are one token each (about 4 characters a token, as the
  router assumes), messages wrapped in a ChatML-like template; an answer's tokens are exactly its text's
  (the next turn's prompt re-uses them, which real tokenizers do only mostly).

Workload (seeded; identical for every policy and printed as a fingerprint): --prompts-per-worker x N
system prompts of --system-tokens (popularity Zipf --zipf, 0 = uniform); --sessions-per-worker x N
sessions arrive as a Poisson process at --load times the rate N workers serve with no prefix cache at
full batches (the estimate is printed); each does --turns turns (system + every earlier turn + a new user
message; the answer is --answer-tokens), the next turn --think-s after the answer (exponential mean;
0: at once). Measured: the jobs submitted after the first --warmup-frac of the arrivals and before
the last arrival (the window): prefix-cache hit rate (cached / prompt
tokens), TTFT p50/p99 (submit to the end of the step that computed the prompt's last token),
completion tokens/s and jobs/s of jobs finished in the window, the routing outcomes, and how often a
job routed to a worker for its prefix found less than 64 tokens in that worker's cache (`stale`).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import math
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.machine import CACHE_DIR
from bench.harness.stats import percentile
from clients.routing import (
    POLICIES,
    Segment,
    WorkerView,
    answer_chain,
    choose,
    matched_tokens,
    prefix_chain,
)
from streamer.block_manager import BlockManager
from streamer.request import Sequence
from streamer.sampling_params import SamplingParams
from workers.progress_display import task
from workers.worker.accounting import FLUSH_S, PrefixAdvert

MIN_MATCH_TOKENS = 64  # choose(min_match_tokens=...)'s default
IM_START, IM_END, NEWLINE = 3, 4, 10  # template tokens; words are ids from FIRST_WORD_ID up
ROLE_IDS = {"system": 5, "user": 6, "assistant": 7}
FIRST_WORD_ID = 16


# --- the step-time model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepModel:
    a: float  # seconds per step
    b: float  # seconds per scheduled token

    def seconds(self, tokens: int) -> float:
        return self.a + self.b * tokens


def fit(points: list[tuple[int, float]]) -> StepModel:
    """Least squares of seconds = a + b * tokens."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return StepModel(max(0.0, my - b * mx), b)


def engine_steps(engine: Any, batch: int, prompt: int, out: int, rng: random.Random) -> list[Any]:
    """Run `batch` requests of `prompt` random tokens to `out` tokens; the engine's step records."""
    for i in range(batch):
        ids = [rng.randrange(FIRST_WORD_ID, 500) for _ in range(prompt)]
        engine.add_request(f"m{rng.random()}-{i}", ids, SamplingParams(max_tokens=out, temperature=0.0,
                                                                       ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.take_step_records()


def step_checkpoint(which: str, tmp: Path) -> Path:
    """`tiny`: bench/routing.py's random Llama; `110m`: bench/throughput.py's (a model whose steps
    take ~50x longer on this CPU, as a large model's do on a GPU), built once into ~/.cache."""
    if which == "110m":
        from bench.harness.workload import bench_checkpoint

        return bench_checkpoint(CACHE_DIR)
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    return build_checkpoint(tmp / "tiny", TinyModelSpec(arch="llama", max_position_embeddings=4096), seed=1)


def typical(seconds: list[float]) -> float:
    """The lower fifth of a sample: this machine is shared, and the steps another job slowed down
    are not what the engine costs."""
    return sorted(seconds)[len(seconds) // 5]


def measure_step_model(ckpt: Path) -> tuple[StepModel, list[tuple[str, int, float]]]:
    """Step time of decode batches and of whole prompts of several sizes, on the engine."""
    from streamer import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=1024, max_num_seqs=16,
                                    enable_prefix_caching=False, device="cpu"))
    rng = random.Random(0)
    engine_steps(engine, 2, 64, 8, rng)  # warm-up: first steps pay for lazy initialisation
    rows = []
    for batch in (1, 4, 8, 16):  # decodes: `batch` tokens a step
        decodes = [r.total_s for r in engine_steps(engine, batch, 16, 24, rng) if not r.num_prefill_tokens]
        rows.append(("decode", batch, typical(decodes)))
    for prompt in (256, 512, 1024, 1536):  # one prompt in one step (the longest prompts here are ~1,400)
        prefills = [r.total_s for _ in range(5) for r in engine_steps(engine, 1, prompt, 1, rng)
                    if r.num_prefill_tokens]
        rows.append(("prompt", prompt, typical(prefills)))
    engine.shutdown()
    return fit([(tokens, s) for _, tokens, s in rows]), rows


# --- the workload ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Message:
    role: str
    text: str
    ids: tuple[int, ...]  # the template's tokens around the words' tokens

    @property
    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text}


class Vocabulary:
    """Pseudo-words of 1-5 letters (about 4 characters a token with the space), one token each."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 5)))
                      for _ in range(size)]

    def message(self, role: str, rng: random.Random, tokens: int, head: str = "") -> Message:
        picks = rng.choices(range(len(self.words)), k=tokens)
        text = head + " ".join(self.words[i] for i in picks)
        head_ids = [FIRST_WORD_ID + len(self.words) + (ord(c) % 64) for c in head]  # a few ids of its own
        return Message(role, text, (IM_START, ROLE_IDS[role], *head_ids, *(FIRST_WORD_ID + i for i in picks),
                                    IM_END, NEWLINE))


@dataclass(frozen=True)
class SessionStart:
    at: float
    index: int
    system: int
    seed: int  # of its user messages, answers and pauses


@dataclass
class Workload:
    vocab: Vocabulary
    systems: list[Message]
    starts: list[SessionStart]
    args: argparse.Namespace
    turns: dict[int, list[tuple[Message, Message, float]]] = field(default_factory=dict)  # made once, for all policies

    def session_turns(self, start: SessionStart) -> list[tuple[Message, Message, float]]:
        """(user message, answer, pause before the next turn) of each turn of a session."""
        if start.index not in self.turns:
            rng, args = random.Random(start.seed), self.args
            self.turns[start.index] = [
                (self.vocab.message("user", rng, args.user_tokens, f"Question {t}: "),
                 self.vocab.message("assistant", rng, args.answer_tokens),
                 rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0) for t in range(args.turns)]
        return self.turns[start.index]

    @property
    def window(self) -> tuple[float, float]:
        """The measured part: after the caches filled, while sessions still arrive."""
        end = self.starts[-1].at
        return self.args.warmup_frac * end, end

    def fingerprint(self) -> str:
        blob = json.dumps([[m.text for m in self.systems], [(round(s.at, 6), s.system, s.seed) for s in self.starts],
                           self.args.turns, self.args.user_tokens, self.args.answer_tokens, self.args.think_s])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def make_workload(args: argparse.Namespace, workers: int, rate: float) -> Workload:
    rng = random.Random(args.seed * 1_000_003 + workers)
    vocab = Vocabulary(4096, random.Random(args.seed))
    n = max(1, round(args.prompts_per_worker * workers))
    systems = [vocab.message("system", rng, args.system_tokens, f"You are assistant number {k}. ")
               for k in range(n)]
    weights = zipf_weights(n, args.zipf)
    starts, t = [], 0.0
    for i in range(args.sessions_per_worker * workers):
        t += rng.expovariate(rate)
        starts.append(SessionStart(t, i, rng.choices(range(n), weights)[0], rng.randrange(2**62)))
    return Workload(vocab, systems, starts, args)


# --- jobs and sessions -------------------------------------------------------------------------------

@dataclass
class Job:
    id: str
    session: Session
    messages: list[Message]
    answer: Message
    submitted: float
    prompt_ids: list[int] = field(default_factory=list)
    chain: list[Segment] = field(default_factory=list)
    first: float = math.inf
    done: float = math.inf
    cached: int = -1  # the BlockManager's prefix hit when it was first admitted
    outcome: str = ""
    routed_for_prefix: int = 0  # the advertised match the router went by (0: not routed for a prefix)
    routed: bool = False  # sent to a worker's own stream

    @property
    def as_dict(self) -> dict[str, Any]:
        return {"messages": [m.as_dict for m in self.messages]}


class Session:
    def __init__(self, start: SessionStart, workload: Workload) -> None:
        self.id, self.turn = f"s{start.index}", 0
        self.plan = workload.session_turns(start)
        self.history: list[Message] = [workload.systems[start.system]]

    def next_job(self, now: float) -> Job:
        user, answer, _ = self.plan[self.turn]
        self.history.append(user)
        job = Job(f"{self.id}-{self.turn}", self, list(self.history), answer, now)
        job.prompt_ids = [t for m in job.messages for t in m.ids] + [IM_START, ROLE_IDS["assistant"]]
        job.chain = prefix_chain(job.as_dict)  # what the router and the worker both compute
        self.turn += 1
        return job

    def answered(self, job: Job) -> None:
        self.history.append(job.answer)

    def pause(self) -> float:
        return self.plan[self.turn - 1][2]


# --- the simulated worker ----------------------------------------------------------------------------

class FastBlocks(BlockManager):
    """The engine's block manager with a cheaper chained hash (Python's tuple hash: deterministic for
    ints, 64 bits) in place of BLAKE2b; everything else is the engine's own code."""

    def _full_block_hashes(self, seq: Sequence, known: list[Any], num_tokens: int) -> list[Any]:
        hashes, bs, ids = list(known), self.block_size, seq.token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash((hashes[-1] if hashes else 0, *ids[i * bs:(i + 1) * bs])))
        return hashes


PARAMS = SamplingParams(max_tokens=1)  # a Sequence needs some; the simulation decides lengths itself


class SimWorker:
    def __init__(self, name: str, cluster: Cluster, args: argparse.Namespace) -> None:
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


# --- results -----------------------------------------------------------------------------------------

def summarize(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    start, end = cluster.workload.window
    window = [j for j in cluster.jobs if start <= j.submitted < end]
    admitted = [j for j in window if j.cached >= 0]
    prompt = sum(len(j.prompt_ids) for j in admitted)
    finished = [j for j in cluster.jobs if start <= j.done < end]
    span = end - start
    outcomes: dict[str, int] = {}
    for j in window:
        outcomes[j.outcome] = outcomes.get(j.outcome, 0) + 1
    for_prefix = [j for j in admitted if j.routed_for_prefix]
    stale = sum(1 for j in for_prefix if j.cached < MIN_MATCH_TOKENS)
    return {"workers": len(cluster.workers), "policy": cluster.policy, "jobs": len(window),
            "hit_rate": sum(j.cached for j in admitted) / max(1, prompt),
            "ttft_p50_ms": percentile([j.first - j.submitted for j in window], 0.5) * 1000,
            "ttft_p99_ms": percentile([j.first - j.submitted for j in window], 0.99) * 1000,
            "tok_s": len(finished) * args.answer_tokens / span, "jobs_s": len(finished) / span,
            "unfinished": sum(1 for j in window if j.done == math.inf),
            "stale": stale / max(1, len(for_prefix)), "outcomes": outcomes}


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'N':>3} {'policy':<12} {'jobs':>6} {'hit rate':>8} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'compl tok/s':>11} {'jobs/s':>7} {'unfin':>5} {'stale':>6}  outcomes")
    for r in rows:
        outcomes = " ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        print(f"{r['workers']:>3} {r['policy']:<12} {r['jobs']:>6} {r['hit_rate']:>8.3f} {r['ttft_p50_ms']:>11.0f} "
              f"{r['ttft_p99_ms']:>11.0f} {r['tok_s']:>11.0f} {r['jobs_s']:>7.1f} {r['unfinished']:>5} "
              f"{r['stale']:>6.1%}  {outcomes}")


# --- main --------------------------------------------------------------------------------------------

def worker_rate(args: argparse.Namespace, model: StepModel) -> float:
    """Jobs/s one worker serves with no prefix cache, its seats all decoding: the load's unit."""
    turn_tokens = args.user_tokens + 6 + (args.answer_tokens + 4)
    prompt = args.system_tokens + 10 + turn_tokens * (args.turns - 1) / 2 + args.user_tokens + 8
    batch = args.max_num_seqs
    per_job = args.answer_tokens * model.seconds(batch) / batch + model.b * prompt
    return 1.0 / per_job


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="16,32,64", help="cluster sizes, comma-separated")
    ap.add_argument("--policies", default="cache_load,cache,least_loaded,random,shared")
    ap.add_argument("--load", type=float, default=0.7, help="offered load, in units of the no-cache capacity")
    ap.add_argument("--sessions-per-worker", type=int, default=36, help="sessions in all: this x N")
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="share of the arrival time not measured")
    ap.add_argument("--prompts-per-worker", type=float, default=8 / 3,
                    help="distinct system prompts per worker (bench/routing.py: 8 on 3 workers)")
    ap.add_argument("--zipf", type=float, default=0.0, help="popularity skew of the system prompts (0: uniform)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--think-s", type=float, default=0.0, help="mean pause before a session's next turn")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--heartbeat-s", type=float, default=FLUSH_S,
                    help="how often workers publish the jobs they hold (their accounting flush: 0.25 s)")
    ap.add_argument("--step-checkpoint", choices=("tiny", "110m"), default="tiny",
                    help="the random checkpoint whose engine steps are measured")
    ap.add_argument("--step-model", default=None, help="A,B: seconds = A + B x tokens, instead of measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON line too")
    args = ap.parse_args()
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)} (clients/routing.py has {', '.join(POLICIES)})")
    return args


def step_model(args: argparse.Namespace) -> StepModel:
    if args.step_model:
        a, b = (float(x) for x in args.step_model.split(","))
        print(f"step model (given): seconds = {a * 1000:.2f} ms + {b * 1e6:.2f} us x tokens")
        return StepModel(a, b)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = step_checkpoint(args.step_checkpoint, Path(tmp))
        with task(f"measuring engine steps ({args.step_checkpoint})"):
            model, rows = measure_step_model(ckpt)
    points = ", ".join(f"{kind} {n}: {s * 1000:.1f} ms" for kind, n, s in rows)
    print(f"step model (LLMEngine on CPU, {args.step_checkpoint} random Llama, lower fifth): {points}")
    print(f"  fit: seconds = {model.a * 1000:.2f} ms + {model.b * 1e6:.2f} us x tokens")
    return model


def main() -> None:
    args = parse_args()
    model = step_model(args)
    sizes = [int(x) for x in args.workers.split(",")]
    policies = args.policies.split(",")
    rows = []
    for n in sizes:
        rate = args.load * n * worker_rate(args, model) / args.turns
        workload = make_workload(args, n, rate)
        print(f"N={n}: workload {workload.fingerprint()}: {len(workload.starts)} sessions ({rate:.1f}/s) x "
              f"{args.turns} turns, {len(workload.systems)} system prompts, zipf {args.zipf}", flush=True)
        for policy in policies:
            with task(f"N={n} {policy}"):
                t0 = time.perf_counter()
                cluster = Cluster(args, n, policy, model, workload)
                cluster.run(3 * workload.window[1] + 10)  # an overloaded policy's backlog is left unfinished
                rows.append({**summarize(cluster, args), "sim_s": time.perf_counter() - t0})
    print_rows(rows)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
