"""Fault runs: N concurrent OpenAI-API streams through the real system while the gateway is SIGKILLed,
Redis restarts or a worker is SIGKILLed, each stream resumed or retried with the same id as the
documented client does.

    python -m bench.faults [--streams 600] [--fault gateway-kill|redis-restart|worker-kill] [--fault-at 10]
                           [--redis-down 5] [--max-tokens 32] [--workers 1] [--claim-idle 5] [--json PATH]
    streamer bench faults ...                                   (the same, through the CLI)

The system is soak.py's: a private redis-server with AOF, `--workers` `streamer worker` processes on a
tiny random Llama (CPU) and one `streamer gateway` process. Every stream is a streamed
`/v1/completions` of one of `--prompts` token-id prompts (greedy, ignore_eos, `--max-tokens`), with
its own `X-Request-Id` and `X-Resumable-Stream: true`. A client (docs/openai.md) that:
  * cannot connect, or gets 503 before its stream opened, POSTs again with the same id;
  * gets 409 `duplicate_id` (its first POST did reach Redis) resumes `GET /v1/streams/ID`;
  * loses the stream midway resumes with `Last-Event-ID` (the last SSE id it received);
  * is told `unknown_request` on a resume (no job holds the id) POSTs again with the same id.
First each prompt is streamed once, alone and with no fault (`same_as_solo_run` counts the streams
whose answer equals it: greedy decoding of the tiny random model is not batch-invariant, so this is
information, not a failure). Then the streams
start together and `--fault-at` seconds later the fault happens: the gateway is SIGKILLed and started
again on its port, or Redis is stopped for `--redis-down` seconds and started again on its AOF, or
worker 0 is SIGKILLed and started again (its jobs are taken over after `--claim-idle` seconds, by
another worker or by the restarted one, from their last event: the streams stay open through it).

Counted per stream: finished (`[DONE]` after a finishing chunk), identical (its text equals what an
uninterrupted reader of its events stream in Redis reads: no gap, no repeat), duplicated (an SSE id
received twice), errors (an error event or refusal, by code), and what the clients had to do
(connections refused, 409s, cuts, `unknown_request` resumes). The exit status is 1 unless every stream
finished identical with none duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.parts.soak.clients import NAMES
from bench.parts.soak.system import System, tiny_checkpoint


@dataclass
class Stream:
    rid: str
    prompt: int
    text: str = ""
    seen: set[str] = field(default_factory=set)
    last_id: str | None = None
    finished: bool = False
    duplicated: int = 0
    error: str | None = None
    actions: Counter[str] = field(default_factory=Counter)


MODEL = {"id": ""}  # what the workers serve, read from /v1/models before the run


def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def _read_sse(resp: httpx.Response, s: Stream) -> str:
    """Consume one SSE response: 'done' ([DONE] seen), or 'cut' (the connection ended first)."""
    sse_id: str | None = None
    try:
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                sse_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    return "done"
                if sse_id is not None:
                    if sse_id in s.seen:
                        s.duplicated += 1
                    s.seen.add(sse_id)
                    s.last_id = sse_id
                chunk = json.loads(data)
                if "error" in chunk:
                    s.error = chunk["error"].get("code") or chunk["error"].get("message")
                    continue
                for choice in chunk.get("choices", []):
                    s.text += choice.get("text") or ""
                    if choice.get("finish_reason"):
                        s.finished = True
                sse_id = None
    except (httpx.HTTPError, OSError):
        return "cut"
    return "cut"


async def run_stream(client: httpx.AsyncClient, s: Stream, prompt: list[int], max_tokens: int,
                     deadline: float) -> None:
    mode = "post"
    while time.monotonic() < deadline and not (s.finished and mode == "done"):
        headers = {"X-Request-Id": s.rid, "X-Resumable-Stream": "true"}
        try:
            if mode == "post":
                request = client.build_request("POST", "/v1/completions", json=_body(prompt, max_tokens),
                                               headers=headers)
            else:
                if s.last_id is not None:
                    headers["Last-Event-ID"] = s.last_id
                request = client.build_request("GET", f"/v1/streams/{s.rid}", headers=headers)
            resp = await client.send(request, stream=True)
        except (httpx.HTTPError, OSError):
            s.actions["connect_failed"] += 1
            await asyncio.sleep(random.uniform(0.5, 1.5))
            continue
        try:
            if resp.status_code == 200:
                outcome = await _read_sse(resp, s)
                if outcome == "done":
                    mode = "done"
                    break
                s.actions["cut"] += 1
                mode = "resume"
            elif resp.status_code == 409:
                s.actions["duplicate_id"] += 1
                mode = "resume"
            elif resp.status_code == 404 and mode == "resume":
                s.actions["unknown_request"] += 1
                mode = "post"
            else:
                s.actions[f"http_{resp.status_code}"] += 1
                if resp.status_code == 400 and mode == "resume":
                    s.error = (await resp.aread()).decode(errors="replace")[:200]
                    return
        finally:
            await resp.aclose()
        await asyncio.sleep(random.uniform(0.2, 1.0))


async def fault_run(args: argparse.Namespace, system: Any, prompts: list[list[int]]) -> dict[str, Any]:
    url = f"http://127.0.0.1:{system.gateway_ports[0]}"
    limits = httpx.Limits(max_connections=args.streams + 50, max_keepalive_connections=args.streams + 50)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, connect=5), limits=limits) as client:
        MODEL["id"] = (await client.get("/v1/models")).json()["data"][0]["id"]
        # The uninterrupted answers: each prompt once, no fault.
        baseline = [Stream(f"base-{i}", i) for i in range(len(prompts))]
        await asyncio.gather(*(run_stream(client, s, prompts[s.prompt], args.max_tokens, time.monotonic() + 300)
                               for s in baseline))
        expected = {s.prompt: s.text for s in baseline}
        if not all(s.finished for s in baseline):
            raise RuntimeError(f"the baseline did not finish: the system is not serving ({baseline[0]})")
        streams = [Stream(f"f-{args.seed}-{i}", i % len(prompts)) for i in range(args.streams)]
        deadline = time.monotonic() + args.timeout
        started = time.monotonic()
        tasks = [asyncio.create_task(run_stream(client, s, prompts[s.prompt], args.max_tokens, deadline))
                 for s in streams]
        await asyncio.sleep(args.fault_at)
        in_flight = sum(1 for t in tasks if not t.done())
        fault: dict[str, Any] = {"kind": args.fault, "at_s": round(time.monotonic() - started, 1),
                                 "streams_unfinished": in_flight}
        if args.fault == "gateway-kill":
            fault.update(await asyncio.to_thread(_kill_gateway, system))
        elif args.fault == "worker-kill":
            fault.update(await asyncio.to_thread(system.kill_worker, 0))
        else:
            fault.update(await asyncio.to_thread(_restart_redis, system, args.redis_down))
        await asyncio.gather(*tasks)
        took = time.monotonic() - started
    durable = await asyncio.to_thread(_durable_texts, system, [s.rid for s in streams])
    finished = [s for s in streams if s.finished]
    identical = [s for s in finished if s.text == durable[s.rid]]
    actions: Counter[str] = Counter()
    for s in streams:
        actions.update(s.actions)
    return {"streams": len(streams), "finished": len(finished), "identical": len(identical),
            "duplicated": sum(1 for s in streams if s.duplicated), "errors": Counter(s.error for s in streams
                                                                                     if s.error),
            "client_actions": dict(actions), "fault": fault, "seconds": round(took, 1),
            "same_as_solo_run": sum(1 for s in finished if s.text == expected[s.prompt]),
            "not_finished": [s.rid for s in streams if not s.finished][:20],
            "different": [{"id": s.rid, "got": s.text[:80], "want": durable[s.rid][:80]}
                          for s in finished if s.text != durable[s.rid]][:5]}


def _durable_texts(system: Any, rids: list[str]) -> dict[str, str]:
    """Each request's answer as its events stream holds it: what a reader that was never interrupted
    reads (the worker's events, each seq once)."""
    from clients.protocol import decode_event

    r = system.redis_client()
    try:
        texts = {}
        for rid in rids:
            events = [decode_event(fields) for _, fields in r.xrange(NAMES.events(rid))]
            texts[rid] = "".join(e.get("text", "") for e in events if e.get("type") in ("token", "done"))
        return texts
    finally:
        r.close()


def _kill_gateway(system: Any) -> dict[str, Any]:
    p = system.gateways[0]
    assert p is not None
    p.kill()
    p.wait()
    t0 = time.monotonic()
    system.start_gateway(0)
    system.wait_gateway(system.gateway_ports[0], 60)
    return {"killed_pid": p.pid, "back_after_s": round(time.monotonic() - t0, 1)}


def _restart_redis(system: Any, down_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    system.redis.stop()
    time.sleep(down_s)
    system.redis.start(timeout=120)
    back = time.monotonic()
    system.wait_gateway(system.gateway_ports[0], 60)  # /readyz 200 again: pub/sub included
    return {"down_s": round(back - t0, 1), "gateway_ready_after_s": round(time.monotonic() - back, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=600)
    ap.add_argument("--fault", choices=("gateway-kill", "redis-restart", "worker-kill"), default="gateway-kill")
    ap.add_argument("--fault-at", type=float, default=10.0, help="seconds after the streams start")
    ap.add_argument("--redis-down", type=float, default=5.0, help="seconds Redis stays stopped")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts (8-48 random tokens each)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--claim-idle", type=float, default=5.0,
                    help="workers' --claim-idle: seconds before a killed worker's jobs are taken over")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="per worker")
    ap.add_argument("--worker-threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds every stream gets to finish")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "streamer-bench"))
    args = ap.parse_args()
    from transformers import AutoConfig

    ckpt = tiny_checkpoint(Path(args.cache))
    vocab = AutoConfig.from_pretrained(ckpt).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(rng.randint(8, 48))] for _ in range(args.prompts)]
    # What soak.System reads of its arguments.
    args.gateways, args.events_ttl = 1, 600.0
    args.kv_blocks = args.max_num_seqs * ((48 + args.max_tokens + 15) // 16 + 1)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="streamer-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    system = System(args, ckpt, log_dir)
    try:
        system.start()
        result = asyncio.run(fault_run(args, system, prompts))
    finally:
        system.stop()
    result["errors"] = dict(result["errors"])
    print(json.dumps(result, indent=2))
    print(f"logs in {log_dir}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = result["finished"] == result["identical"] == result["streams"] and result["duplicated"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
