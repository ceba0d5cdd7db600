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

This file is the run itself; the step-time model, the workload, the simulated worker and the cluster
are in bench/parts/routing_sim/.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.stats import percentile
from bench.parts.routing_sim.cluster import Cluster
from bench.parts.routing_sim.step_model import MIN_MATCH_TOKENS, StepModel, measure_step_model, step_checkpoint
from bench.parts.routing_sim.workload import make_workload
from clients.routing import POLICIES
from workers.progress_display import task
from workers.worker.accounting import FLUSH_S

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
