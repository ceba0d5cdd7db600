"""Soak: N concurrent streams for D minutes through the real system, with faults injected every minute.

    python -m bench.soak [--streams 1000] [--minutes 10] [--workers 3] [--gateways 2]
                         [--fault-every 60] [--no-faults] [--json PATH]
    streamer bench soak ...                                   (the same, through the CLI)

The system is the real one, each part its own process: a private redis-server with AOF on a free
loopback port, `--workers` `streamer worker` processes on a tiny random Llama (CPU), `--gateways`
`streamer gateway` processes. `--streams` clients keep a steady load: each loops submitting a request
(greedy, ignore_eos, max_tokens drawn from --max-tokens), streaming it to its end, checking it, and
submitting the next. `--ws-share` of them go through a gateway (one WebSocket each, like a browser
tab), the others straight to Redis with the Python `AsyncClient` (half JSON, half msgpack). They run
in `--client-procs` processes.

Every `--fault-every` seconds, staggered over the period (a quarter, half and three quarters in):
  * one worker is SIGKILLed and started again (its jobs are taken over after --claim-idle seconds);
    worker 0 is never killed, so its RSS shows the trend of a long-lived worker;
  * Redis is stopped and started again on the same port with the same AOF file;
  * `--drop-share` of the clients are disconnected: a WebSocket client drops its socket (TCP abort,
    no close frame) and resumes on a random gateway with `after_seq`; a Redis client stops reading
    (its XREAD is cut) and resumes its stream after the last seq it holds.

Each stream is checked as it arrives: `seq` must go 0, 1, 2 ... (a gap counts as lost events, a seq
seen twice as a duplicate), and a finished request must hold exactly max_tokens tokens, equal to the
offline engine's greedy tokens for its prompt (computed once before the run). After --minutes,
clients submit nothing new and the requests in flight get --drain seconds to finish; those that do
not, and those silent for --stall-timeout seconds during the run, never finished.

Every --sample-every seconds it records Redis `used_memory`, the RSS of each worker and gateway (from
/proc/PID/status), the backlog, and the requests done so far. The report (printed; as JSON with
--json PATH) gives requests completed and failed (by error code), events lost and duplicated, streams
never finished, wrong outputs, TTFT and request latency p50/p99, and first/last/max and slope of
each memory series. The exit status is 1 when any event was lost or duplicated, any stream never
finished, any output was wrong, a frame came for a request after its final event, a process crashed
on its own, or a gateway (or Redis) no longer serves a fresh request after the soak; else 0.

Events are kept --events-ttl seconds (default 120, not the 1 h default), so Redis reaches its steady
state within the run and a leak shows as a slope. Keep it above the longest a request may go silent
(a takeover after --claim-idle, the queue): a client resuming after its events expired is refused.
Logs of every worker and gateway are kept in --log-dir (default: a new temporary directory, printed).

This file is the run itself; its clients, system and report are in bench/parts/soak/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.parts.soak.clients import COUNTERS, client_process
from bench.parts.soak.report import mb, merge, report
from bench.parts.soak.system import System, diagnose, probe, reference_process, sample, tiny_checkpoint, waiting
from workers.progress_display import task as progress_task

# --- the run -----------------------------------------------------------------------------------------

def fault_schedule(duration: float, every: float) -> list[tuple[float, str]]:
    plan = []
    k = 0
    while k * every < duration:
        for offset, kind in ((0.25, "kill_worker"), (0.5, "restart_redis"), (0.75, "drop_clients")):
            if (t := (k + offset) * every) < duration:
                plan.append((t, kind))
        k += 1
    return plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1000, help="concurrent streams (clients)")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of load")
    ap.add_argument("--workers", type=int, default=3, help="`streamer worker` processes")
    ap.add_argument("--gateways", type=int, default=2, help="`streamer gateway` processes")
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between rounds of faults")
    ap.add_argument("--no-faults", action="store_true", help="steady load only")
    ap.add_argument("--json", type=Path, default=None, help="write the results (and the series) here")
    ap.add_argument("--ws-share", type=float, default=0.5, help="share of the streams through a gateway")
    ap.add_argument("--drop-share", type=float, default=0.1, help="share of the clients cut per drop fault")
    ap.add_argument("--max-tokens", default="16,64", help="each request's max_tokens: uniform in LO,HI")
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts (8-48 random tokens each)")
    ap.add_argument("--client-procs", type=int, default=2, help="processes the clients are spread over")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="per worker")
    ap.add_argument("--kv-blocks", type=int, default=0, help="per worker (0: room for max-num-seqs requests)")
    ap.add_argument("--worker-threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    ap.add_argument("--claim-idle", type=float, default=30.0,
                    help="workers' --claim-idle: seconds before a dead worker's jobs are taken over")
    ap.add_argument("--events-ttl", type=float, default=120.0, help="workers' --events-ttl (seconds)")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory samples")
    ap.add_argument("--stall-timeout", type=float, default=300.0,
                    help="a request silent this long during the run never finished")
    ap.add_argument("--drain", type=float, default=0.0,
                    help="seconds the requests in flight at the end get to finish (0: 60 + 3 x claim-idle)")
    ap.add_argument("--ramp", type=float, default=10.0, help="clients start spread over this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None, help="worker and gateway logs (default: a temp dir)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "streamer-bench"))
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    if args.workers < 1 or args.gateways < 0 or not 0 <= args.ws_share <= 1 or not 1 <= lo <= hi:
        ap.error("need --workers >= 1, --gateways >= 0, 0 <= --ws-share <= 1, 1 <= LO <= HI")
    if args.gateways == 0:
        args.ws_share = 0.0
    args.kv_blocks = args.kv_blocks or args.max_num_seqs * ((48 + hi + 15) // 16 + 1)
    drain = args.drain or 60 + 3 * args.claim_idle
    duration = args.minutes * 60
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="streamer-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    wall0 = time.monotonic()
    load0 = os.getloadavg()[0]

    from transformers import AutoConfig

    ckpt = tiny_checkpoint(Path(args.cache))
    vocab = AutoConfig.from_pretrained(ckpt).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(rng.randint(8, 48))] for _ in range(args.prompts)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ref = ctx.Process(target=reference_process, args=(str(ckpt), prompts, hi, {
        "num_kv_blocks": args.kv_blocks, "max_num_seqs": args.max_num_seqs, "device": "cpu", "dtype": "float32"}, q))
    ref.start()
    print(f"computing the reference: greedy tokens of {len(prompts)} prompts with the offline engine", flush=True)
    refs = None
    with progress_task("computing the reference"):
        while refs is None:
            try:
                refs = q.get(timeout=1.0)
            except queue.Empty:
                if not ref.is_alive() and q.empty():
                    raise RuntimeError(f"the reference process exited with status {ref.exitcode}") from None
    ref.join(60)
    print(f"logs of the workers and gateways in {log_dir}", flush=True)

    system = System(args, ckpt, log_dir)
    series: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    procs: list[Any] = []
    try:
        with progress_task(f"starting redis, {args.workers} workers, {args.gateways} gateways"):
            system.start()
        print(f"up: redis {system.redis.url}, {args.workers} workers, gateways {system.ws_urls} "
              f"({time.monotonic() - wall0:.0f}s)", flush=True)
        n_ws = round(args.streams * args.ws_share)
        specs = [("ws", i) for i in range(n_ws)] + [("redis", i) for i in range(args.streams - n_ws)]
        random.Random(args.seed).shuffle(specs)
        cfg = {"redis_url": system.redis.url, "ws_urls": system.ws_urls, "prompts": prompts, "refs": refs,
               "max_tokens": (lo, hi), "stall_timeout": args.stall_timeout, "seed": args.seed,
               "ramp_s": args.ramp}
        nprocs = max(1, min(args.client_procs, args.streams))
        ctrls = [ctx.Queue() for _ in range(nprocs)]
        out = ctx.Queue()
        progress = [ctx.Array("q", len(COUNTERS), lock=False) for _ in range(nprocs)]
        procs = [ctx.Process(target=client_process, args=(cfg, specs[k::nprocs], ctrls[k], out, progress[k]),
                             daemon=True) for k in range(nprocs)]
        for p in procs:
            p.start()
        plan = [] if args.no_faults else fault_schedule(duration, args.fault_every)
        killable = list(range(1, args.workers)) or [0]
        kills = 0
        t0 = time.monotonic()
        next_sample = 0.0

        def tick() -> float:
            nonlocal next_sample
            elapsed = time.monotonic() - t0
            system.check_alive(elapsed)
            if elapsed >= next_sample:
                row = sample(system, elapsed, progress)
                series.append(row)
                next_sample += args.sample_every
                print(f"[{elapsed:6.0f}s] done {row['completed']:>7} failed {row['failed']:>4} "
                      f"lost {row['lost']} dup {row['duplicated']} unfinished {row['unfinished']} "
                      f"wrong {row['wrong']} | redis {mb(row.get('redis_used_memory'))} MB "
                      f"jobs {row.get('running', '-')}+{waiting(row)} | workers "
                      f"{' '.join(mb(v) for v in row['worker_rss'])} MB | gateways "
                      f"{' '.join(mb(v) for v in row['gateway_rss'])} MB", flush=True)
            return elapsed

        with progress_task(f"seconds of load ({args.minutes:g} min)", total=round(duration)) as bar:
            while (elapsed := tick()) < duration:
                bar.update(completed=int(elapsed))
                while plan and plan[0][0] <= elapsed:
                    _, kind = plan.pop(0)
                    record: dict[str, Any] = {"t": round(elapsed, 1), "fault": kind}
                    if kind == "kill_worker":
                        record.update(system.kill_worker(killable[kills % len(killable)]))
                        kills += 1
                    elif kind == "restart_redis":
                        record.update(system.restart_redis())
                    else:
                        for c in ctrls:
                            c.put(("drop", args.drop_share))
                    faults.append(record)
                    print(f"[{elapsed:6.0f}s] fault: {json.dumps(record)}", flush=True)
                if any(not p.is_alive() for p in procs):
                    print(f"[{elapsed:6.0f}s] !! a client process died", flush=True)
                    break
                time.sleep(0.2)
            bar.update(completed=min(round(duration), int(time.monotonic() - t0)))
        stopped_at = time.monotonic() - t0
        print(f"[{stopped_at:6.0f}s] load ends: no new requests; {drain:.0f}s for those in flight", flush=True)
        for c in ctrls:
            c.put(("stop", drain))
        deadline = time.monotonic() + drain + 120
        with progress_task("client processes finished (drain)", total=len(procs)) as bar:
            while len(parts) < len(procs) and time.monotonic() < deadline:
                tick()
                try:
                    parts.append(out.get(timeout=0.5))
                    bar.advance()
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and out.empty():
                        break
        if len(parts) < len(procs):
            parts.append({"client_crashes": [f"{len(procs) - len(parts)} client process(es) sent no result"]})
        series.append(sample(system, time.monotonic() - t0, progress))
        probes = asyncio.run(probe(system, prompts[0], refs[0][:8]))
        res = merge(parts)
        diagnosis = [diagnose(system, u["id"]) for u in res["unfinished"][:20]]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        system.stop()
    summary, bad = report(args, res, series, faults, system, probes, duration, time.monotonic() - wall0,
                          (load0, os.getloadavg()[0]))
    if diagnosis:
        print("\nunfinished requests, as Redis holds them (first 20):")
        for d, u in zip(diagnosis, res["unfinished"]):
            print("  ", json.dumps({k: v for k, v in {**u, **d}.items() if k != "trace"}))
    if args.json:
        doc = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "cpus": os.cpu_count(), "load_average_end": os.getloadavg(), **summary,
               "faults_injected": faults, "crashes": system.crashes, "refused_starts": system.refused_starts,
               "unfinished": res["unfinished"],
               "unfinished_in_redis": diagnosis, "problems": res["samples"], "series": series}
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"results written to {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
