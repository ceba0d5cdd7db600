"""Grammar budgets: what hostile structured_outputs requests do to everyone else's streams.

    python -m bench.grammar_budget [--model DIR] [--victims 3] [--n 8] [--schemas 3] [--json OUT]

A private redis-server and one `streamer worker` (a tiny random checkpoint unless --model). Three
victim streams (plain, greedy) run through two phases, measured from their token events as a client
sees them:

- baseline: a plain 3-token request is sent (its time to first token is measured), nothing else;
- hostile: the ambiguous EBNF grammar of issue 44 (`root ::= x x x x x x x x`, `x ::= y*`,
  `y ::= [a-z] | [a-z] [a-z] | [a-z]* " "?`) with n samples, and `--schemas` JSON schemas of 2,000
  optional properties each (random names: no compile cache helps), then the same plain request.

Reported: the victims' inter-token gap (median, p99) in each phase and their ratio, the plain
request's first token, and what each hostile request got. Before the budgets the grammar's masks
were filled on the step (every stream waited for them) and compiles ran on the tokenizing thread
(the plain request waited for all three). tests/engine/test_grammar_budgets.py runs the same phases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.machine import ROOT
from bench.harness.servers import child_env
from bench.harness.stats import percentile
from clients.redis_client import AsyncClient

AMBIGUOUS = 'root ::= x x x x x x x x\nx ::= y*\ny ::= [a-z] | [a-z] [a-z] | [a-z]* " "?'
PLAIN = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
WARM_UP = {"max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}  # starts the compile process


def wide_schema(properties: int = 2000, seed: int | None = None) -> dict[str, Any]:
    """An object of `properties` optional integer properties, named at random (a fresh schema each call:
    the compile cache never has it), under the 64 KiB spec limit."""
    rng = random.Random(seed)
    prefix = "".join(rng.choices(string.ascii_lowercase, k=3))
    schema = {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(properties)}}
    assert len(json.dumps(schema)) < 64 * 1024
    return schema


@dataclass
class Phase:
    """One phase as the client saw it (seconds)."""

    gaps: list[float] = field(default_factory=list)  # every victim's gaps between token events
    first_token_s: float = float("nan")  # the plain request's
    outcomes: dict[str, str] = field(default_factory=dict)  # hostile request -> "done" or "code: message"

    @property
    def median(self) -> float:
        return statistics.median(self.gaps)

    @property
    def p99(self) -> float:
        return percentile(self.gaps, 0.99)


async def _victim(client: AsyncClient, rid: str, times: list[float]) -> None:
    async for event in client.stream(rid, timeout=120):
        if event["type"] == "token":
            times.append(time.monotonic())


async def outcome(client: AsyncClient, rid: str) -> str:
    """"done", or the error event's "code: message"."""
    async for event in client.stream(rid, timeout=300):
        if event["type"] == "error":
            return f"{event['code']}: {event['message']}"
    return "done"


async def _first_token(client: AsyncClient) -> float:
    sent = time.monotonic()
    rid = await client.submit("plain", params=PLAIN)
    async for event in client.stream(rid, timeout=300):
        if event["type"] == "token":
            return time.monotonic() - sent
    raise AssertionError("the plain request gave no token")


async def run_phase(client: AsyncClient, hostile: bool, victims: int = 3, n: int = 8, schemas: int = 3,
                    baseline_s: float = 2.0, victim_max_tokens: int = 8000, max_s: float = 300.0) -> Phase:
    """Victims streaming; then the plain request (and, `hostile`, the grammar and schemas before it);
    the victims' gaps are taken from then until every other request has its answer (at least
    `baseline_s`, at most `max_s`: what has no answer by then is cancelled and said so), and the
    victims are cancelled."""
    await client.generate("warm up", params=WARM_UP)
    times: list[list[float]] = [[] for _ in range(victims)]
    ids = [await client.submit(f"victim {i}", params={"max_tokens": victim_max_tokens, "ignore_eos": True,
                                                      "temperature": 0}) for i in range(victims)]
    tasks = [asyncio.create_task(_victim(client, rid, t)) for rid, t in zip(ids, times)]
    while min(map(len, times)) < 10:  # every victim decoding
        await asyncio.sleep(0.01)
    start = time.monotonic()
    phase = Phase()
    pending: dict[str, tuple[str, asyncio.Task[str]]] = {}
    if hostile:
        grammar = {"n": n, "temperature": 1.0, "seed": 1, "max_tokens": 200, "min_tokens": 190,
                   "structured_outputs": {"grammar": AMBIGUOUS}}
        sent = {"grammar": await client.submit("words", params=grammar)}
        for k in range(schemas):
            params = {"max_tokens": 16, "structured_outputs": {"json": wide_schema()}}
            sent[f"schema {k}"] = await client.submit("json", params=params)
        pending = {name: (rid, asyncio.create_task(outcome(client, rid))) for name, rid in sent.items()}
    first = asyncio.create_task(_first_token(client))
    await asyncio.wait([first, *(task for _, task in pending.values())], timeout=max_s)
    phase.first_token_s = first.result() if first.done() else float("inf")
    first.cancel()
    for name, (rid, task) in pending.items():
        phase.outcomes[name] = task.result() if task.done() else f"no answer in {max_s:g} s"
        if not task.done():
            await client.cancel(rid)
            task.cancel()
    await asyncio.sleep(max(0.0, start + baseline_s - time.monotonic()))
    end = time.monotonic()
    for rid in ids:
        await client.cancel(rid)
    await asyncio.gather(*tasks)
    for t in times:
        inside = [x for x in t if start <= x <= end]
        phase.gaps += [b - a for a, b in zip(inside, inside[1:])]
    return phase


def report(baseline: Phase, hostile: Phase) -> dict[str, Any]:
    return {
        "baseline": {"median_gap_ms": baseline.median * 1e3, "p99_gap_ms": baseline.p99 * 1e3,
                     "gaps": len(baseline.gaps), "plain_first_token_ms": baseline.first_token_s * 1e3},
        "hostile": {"median_gap_ms": hostile.median * 1e3, "p99_gap_ms": hostile.p99 * 1e3,
                    "gaps": len(hostile.gaps), "plain_first_token_ms": hostile.first_token_s * 1e3,
                    "outcomes": hostile.outcomes},
        "median_ratio": hostile.median / baseline.median,
        "p99_ratio": hostile.p99 / baseline.p99,
    }


# --- the command ------------------------------------------------------------------------------------

def _worker(model: Path, url: str, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--model", str(model), "--redis", url,
           "--grammar-mask-budget-s", str(args.mask_budget_s),
           "--grammar-compile-timeout-s", str(args.compile_timeout_s)]
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(keep_streamer_vars=True))


async def _main(args: argparse.Namespace, url: str) -> dict[str, Any]:
    async with AsyncClient(url) as client:
        deadline = time.monotonic() + 300
        while not await client.live_workers():
            if time.monotonic() > deadline:
                raise SystemExit("the worker did not start (see its log)")
            await asyncio.sleep(0.2)
        common = {"victims": args.victims, "n": args.n, "schemas": args.schemas, "max_s": args.max_s}
        baseline = await run_phase(client, hostile=False, baseline_s=args.baseline_s, **common)
        hostile = await run_phase(client, hostile=True, **common)
        again = await run_phase(client, hostile=False, baseline_s=args.baseline_s, **common)  # load drift
    result = report(baseline, hostile)
    result["baseline_after"] = report(again, hostile)["baseline"]
    return result


def main() -> None:
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint
    from workers.redis_server import RedisServer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny random Llama)")
    p.add_argument("--victims", type=int, default=3)
    p.add_argument("--n", type=int, default=8, help="samples of the ambiguous-grammar request")
    p.add_argument("--schemas", type=int, default=3, help="2,000-property schemas sent")
    p.add_argument("--mask-budget-s", type=float, default=0.2)
    p.add_argument("--compile-timeout-s", type=float, default=10.0)
    p.add_argument("--num-kv-blocks", type=int, default=0)
    p.add_argument("--max-s", type=float, default=300.0, help="longest a phase waits for the hostile answers")
    p.add_argument("--baseline-s", type=float, default=10.0, help="how long the victims are measured alone")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        model = args.model or build_checkpoint(Path(tmp) / "tiny", TinyModelSpec(max_position_embeddings=16384))
        load = os.getloadavg()[0]
        worker = _worker(model, server.url, args, Path(tmp) / "worker.log")
        try:
            result = asyncio.run(_main(args, server.url))
        finally:
            worker.kill()
            worker.wait()
    result["load_average_1m"] = {"before": load, "after": os.getloadavg()[0]}
    result["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
