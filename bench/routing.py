"""Multi-worker routing, for real: a chat workload on 3 `streamer worker` processes, routed to the
worker holding each session's KV and prompt prefix (`cache_load`) against the shared lanes only
(`shared`, where whichever worker has a free seat takes the next job).

    python -m bench.routing [--sessions 96] [--turns 4] [--concurrency 12] [--workers 3]
                            [--prompts 8] [--system-tokens 1000] [--policies cache_load,shared]

Everything runs on this machine: one private redis-server, --workers worker processes on a tiny
random Llama (or --model) with few seats (--max-num-seqs) and a KV cache (--num-kv-blocks) that holds
about 2-3 of the system prompts, so where a job runs decides whether its prompt is computed again.

Workload (seeded, the same in every run; its fingerprint is printed): --prompts distinct system
prompts of about --system-tokens tokens each; --sessions conversations, each picking one system
prompt and doing --turns turns; a turn's messages are the system prompt, every earlier user message
and answer (the answer text the worker really sent), and a new user message of about --user-tokens.
--concurrency sessions run at a time, each turn submitted as soon as the previous answer is done,
all through one AsyncClient (one router, like one gateway), with its session id.

For each policy, on freshly started workers (empty caches) and a flushed Redis: prefix-cache hit rate
(sum of cached_tokens / sum of prompt_tokens, from the `done` events' usage), completion tokens/s and
jobs/s over the whole run, time to first token p50/p99 (from just before submit() to the first
`token` event read by client.stream), and the router's outcomes (session, hit, miss, fallback,
shared). Each policy runs --repeats times, alternated; then the medians, and the ratio of the first
policy's medians to the second's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.harness.machine import ROOT
from bench.harness.servers import child_env, stop_all
from bench.harness.stats import percentile
from clients.heartbeats import live_workers
from clients.protocol import Names, encode_job
from clients.redis_client import AsyncClient
from workers.progress_display import task
from workers.redis_server import RedisServer

NAMES = Names()
# Words the tiny checkpoint's BPE tokenizer mostly has as single tokens, mixed with a few it splits:
# about 3.5 characters a token, near the 4 the router assumes (clients/routing.py CHARS_PER_TOKEN),
# as English has with real tokenizers. The measured ratio is printed.
WORDS = ["the", "to", "and", "in", "for", "at", "an", "new", "any", "step", "cache", "key", "stream", "fox", "dog",
         "quick", "brown", "over", "jumps", "flow", "back", "keys", "test", "main", "range", "every", "carry", "paged",
         "blocks", "clients", "requests", "browsers", "language", "numbers", "values", "stores", "streams", "workers",
         "admits", "batching", "with", "has", "will", "one", "queue", "worker", "redis", "admit", "value", "page",
         "job", "store"]


# --- the workload ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SessionPlan:
    id: str
    system: int  # index of its system prompt
    users: list[str]  # one user message per turn
    thinks: list[float]  # seconds before each turn is sent (after the previous answer)


@dataclass(frozen=True)
class Workload:
    systems: list[str]
    sessions: list[SessionPlan]
    params: dict[str, Any]

    def fingerprint(self) -> str:
        """Hash of everything the client sends but the answers (which the model decides)."""
        blob = json.dumps([self.systems, [asdict(s) for s in self.sessions], self.params], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def text_of_tokens(rng: random.Random, tokenizer: Any, tokens: int, head: str = "") -> str:
    """Random words until the text is `tokens` tokens long for this tokenizer."""
    words = head.split()
    while (have := len(tokenizer(" ".join(words))["input_ids"])) < tokens:
        words += [rng.choice(WORDS) for _ in range(max(1, (tokens - have) // 2))]  # half the gap: little overshoot
    return " ".join(words)


def make_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    rng = random.Random(args.seed)
    # Each prompt starts differently: distinct from its first routing segment (the whole message).
    systems = [text_of_tokens(rng, tokenizer, args.system_tokens, f"You are assistant number {k}.")
               for k in range(args.prompts)]
    sessions = [SessionPlan(f"s{i:04d}-{args.seed}", rng.randrange(args.prompts),
                            [text_of_tokens(rng, tokenizer, args.user_tokens, f"Question {t}:")
                             for t in range(args.turns)],
                            [rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in range(args.turns)])
                for i in range(args.sessions)]
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    return Workload(systems, sessions, params)


def chars_per_token(workload: Workload, tokenizer: Any) -> float:
    text = "".join(workload.systems)
    return len(text) / max(1, len(tokenizer(text)["input_ids"]))


# --- one policy's run --------------------------------------------------------------------------------

@dataclass
class Turn:
    ttft: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Run:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)


async def one_turn(client: AsyncClient, messages: list[dict[str, str]], session: str,
                   params: dict[str, Any]) -> tuple[str, Turn]:
    """Submit a turn and read its events: (the answer's text, what it cost and when it started)."""
    t0 = time.perf_counter()
    rid = await client.submit(messages=messages, params=params, session=session)
    ttft, text, usage = float("nan"), [], {}
    async for event in client.stream(rid, timeout=120):
        if event["type"] == "token":
            if not text:
                ttft = time.perf_counter() - t0
            text.append(event["text"])
        elif event["type"] == "error":
            raise RuntimeError(f"turn of {session} failed: {event.get('code')}: {event.get('message')}")
        else:
            usage = event.get("usage", {})
    return "".join(text), Turn(ttft, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
                               int(usage.get("cached_tokens", 0)))


async def run_session(client: AsyncClient, plan: SessionPlan, workload: Workload, run: Run, bar: Any) -> None:
    messages = [{"role": "system", "content": workload.systems[plan.system]}]
    for user, think in zip(plan.users, plan.thinks, strict=True):
        await asyncio.sleep(think)
        messages.append({"role": "user", "content": user})
        answer, turn = await one_turn(client, list(messages), plan.id, workload.params)
        messages.append({"role": "assistant", "content": answer})  # what the next turn sends back
        run.turns.append(turn)
        bar.advance()


async def drive(url: str, policy: str, workload: Workload, concurrency: int) -> Run:
    """Every session through one client, `concurrency` at a time."""
    run = Run(policy)
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(url, routing=policy) as client:
        async def gated(plan: SessionPlan) -> None:
            async with gate:
                await run_session(client, plan, workload, run, bar)

        total = sum(len(s.users) for s in workload.sessions)
        with task(f"{policy}: turns", total=total) as bar:
            t0 = time.perf_counter()
            await asyncio.gather(*(gated(plan) for plan in workload.sessions))
            run.wall_s = time.perf_counter() - t0
        run.outcomes = dict(client.router.outcomes)
    return run


# --- workers -----------------------------------------------------------------------------------------

def worker_env(threads: int) -> dict[str, str]:
    env = child_env()
    # N workers on a few cores: one thread each, or their matmul threads fight over the cores.
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_workers(args: argparse.Namespace, model: str, url: str, logs: Path) -> list[subprocess.Popen]:
    procs = []
    for i in range(args.workers):
        cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", model, "--redis", url,
               "--consumer", f"w{i}", "--num-kv-blocks", str(args.num_kv_blocks),
               "--max-num-seqs", str(args.max_num_seqs), "--claim-idle", str(args.claim_idle), "--device", "cpu",
               "--log-level", "WARNING"]
        with open(logs / f"w{i}.log", "ab") as out:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=worker_env(args.threads), stdout=out,
                                          stderr=subprocess.STDOUT))
    return procs


def wait_live(r: redis.Redis, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while len(live_workers(r, NAMES)) < len(procs):
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a worker exited while starting (see its log)")
        if time.monotonic() > end:
            raise SystemExit("the workers did not start in time")
        time.sleep(0.2)


async def warm_up(url: str, workers: int) -> None:
    """One short job straight into each worker's own stream: its first steps (lazy initialisation)
    are not counted against the policy measured. Its text is shorter than a routing segment, so it
    advertises nothing."""
    async with AsyncClient(url, routing="shared") as client:
        r = client.redis
        ids = []
        for i in range(workers):
            job = {"id": f"warm-{i}-{time.monotonic_ns()}", "prompt": "warm up",
                   "params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
            await r.xadd(NAMES.worker_requests(f"w{i}"), encode_job(job))
            ids.append(job["id"])
        for rid in ids:
            async for _event in client.stream(rid, timeout=120):
                pass


def run_policy(args: argparse.Namespace, policy: str, model: str, server: RedisServer, workload: Workload,
               logs: Path) -> Run:
    """Fresh workers (empty caches) on a flushed Redis, the workload, then the workers stopped."""
    r = redis.Redis.from_url(server.url)
    r.flushall()
    procs = start_workers(args, model, server.url, logs)
    try:
        with task(f"{policy}: starting {args.workers} workers"):
            wait_live(r, procs)
            asyncio.run(warm_up(server.url, args.workers))
        return asyncio.run(drive(server.url, policy, workload, args.concurrency))
    finally:
        stop_all(procs)
        r.close()


# --- results -----------------------------------------------------------------------------------------

def summary(run: Run) -> dict[str, Any]:
    prompt = sum(t.prompt_tokens for t in run.turns)
    completion = sum(t.completion_tokens for t in run.turns)
    ttfts = [t.ttft for t in run.turns]
    cached = sum(t.cached_tokens for t in run.turns)
    return {"policy": run.policy, "jobs": len(run.turns), "hit_rate": cached / max(1, prompt),
            "prompt_tokens": prompt, "completion_tokens": completion,
            "tok_s": completion / run.wall_s, "jobs_s": len(run.turns) / run.wall_s,
            "ttft_p50_ms": percentile(ttfts, 0.5) * 1000, "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
            "ttft_mean_ms": statistics.fmean(ttfts) * 1000, "wall_s": run.wall_s, "outcomes": run.outcomes}


METRICS = ("hit_rate", "tok_s", "jobs_s", "ttft_p50_ms", "ttft_p99_ms")


def median_row(rows: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    """A policy's median over its repeats, metric by metric."""
    mine = [r for r in rows if r["policy"] == policy]
    med = {m: statistics.median(r[m] for r in mine) for m in (*METRICS, "jobs", "wall_s")}
    return {**med, "policy": policy, "run": "median", "outcomes": {}}


def print_row(s: dict[str, Any]) -> None:
    outcomes = " ".join(f"{k} {v}" for k, v in s["outcomes"].items() if v)
    print(f"{s['policy']:<11} {s['run']:>6} {int(s['jobs']):>5} {s['hit_rate']:>9.3f} {s['tok_s']:>12.1f} "
          f"{s['jobs_s']:>7.2f} {s['ttft_p50_ms']:>12.0f} {s['ttft_p99_ms']:>12.0f} {s['wall_s']:>7.1f}  {outcomes}")


def print_table(rows: list[dict[str, Any]], policies: list[str]) -> None:
    print(f"{'policy':<11} {'run':>6} {'jobs':>5} {'hit rate':>9} {'compl tok/s':>12} {'jobs/s':>7} "
          f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'wall s':>7}  router outcomes")
    for s in rows:
        print_row(s)
    medians = [median_row(rows, p) for p in policies]
    if len({r["run"] for r in rows}) > 1:
        for s in medians:
            print_row(s)
    if len(medians) >= 2:
        a, b = medians[0], medians[1]
        ratios = {m: a[m] / b[m] if b[m] else float("nan") for m in METRICS}
        print(f"{a['policy'] + '/' + b['policy']:<24} {ratios['hit_rate']:>9.2f}x {ratios['tok_s']:>11.2f}x "
              f"{ratios['jobs_s']:>6.2f}x {ratios['ttft_p50_ms']:>11.2f}x {ratios['ttft_p99_ms']:>11.2f}x")


# --- main --------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=96)
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--concurrency", type=int, default=12, help="sessions running at a time")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="mean pause before each turn (exponential; 0: the next turn goes at once, as an agent's)")
    ap.add_argument("--max-tokens", type=int, default=24, help="answer length (ignore_eos)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="each worker's seats")
    ap.add_argument("--num-kv-blocks", type=int, default=256,
                    help="each worker's KV blocks of 16 tokens (256: about 3 system prompts with their turns)")
    ap.add_argument("--claim-idle", type=float, default=30.0,
                    help="the workers' --claim-idle (their default); they beat every quarter of it, at most 5 s, "
                         "and the loads the router weighs come from those beats")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (OMP_NUM_THREADS)")
    ap.add_argument("--policies", default="cache_load,shared",
                    help="routing policies to run, in order (clients/routing.py POLICIES); ratios: first/second")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each policy, alternated (this machine is shared: medians are shown)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random Llama, 4k context)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line too")
    return ap.parse_args()


def build_model(args: argparse.Namespace, tmp: Path) -> str:
    if args.model:
        return args.model
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    with task("building the tiny checkpoint"):
        return str(build_checkpoint(tmp / "tiny", TinyModelSpec(arch="llama", max_position_embeddings=4096), seed=1))


def describe(args: argparse.Namespace, workload: Workload, ratio: float) -> str:
    return (f"workload {workload.fingerprint()}: {args.sessions} sessions x {args.turns} turns, {args.prompts} "
            f"system prompts of {args.system_tokens} tokens ({ratio:.2f} chars/token), user {args.user_tokens} "
            f"tokens, answers {args.max_tokens} tokens, {args.concurrency} sessions at a time, seed {args.seed}; "
            f"{args.workers} workers x {args.max_num_seqs} seats, {args.num_kv_blocks} KV blocks of 16 tokens")


def main() -> None:
    args = parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        model = build_model(args, Path(tmp))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        workload = make_workload(args, tokenizer)
        print(describe(args, workload, chars_per_token(workload, tokenizer)), flush=True)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        try:
            rows = [{**summary(run_policy(args, policy, model, server, workload, logs)), "run": f"#{i + 1}"}
                    for i in range(args.repeats) for policy in policies]  # alternated: drift hits both
        except BaseException:
            for log in sorted(logs.glob("*.log")):  # why a worker failed, before the folder goes
                sys.stderr.write(f"--- {log.name} (last lines)\n" + "".join(log.read_text().splitlines(True)[-20:]))
            raise
    print_table(rows, policies)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
