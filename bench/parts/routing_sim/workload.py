"""The routing simulation's workload: chat sessions over shared system prompts, their jobs and
turns (bench/routing_sim.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from bench.parts.routing_sim.step_model import FIRST_WORD_ID, IM_END, IM_START, NEWLINE, ROLE_IDS
from clients.routing import Segment, prefix_chain

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
