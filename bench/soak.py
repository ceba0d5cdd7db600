"""Soak: N concurrent streams for D minutes through the real system, with faults injected every minute.

    python bench/soak.py [--streams 1000] [--minutes 10] [--workers 3] [--gateways 2]
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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # bench/kernels.py must not shadow the `kernels` package

from clients.protocol import Names  # noqa: E402
from workers.progress_display import task as progress_task  # noqa: E402

NAMES = Names()
FINAL = ("done", "error")
# Progress counters each client process keeps in shared memory (the parent prints them live).
COUNTERS = ("completed", "failed", "lost", "duplicated", "unfinished", "wrong", "drops", "resumes")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# --- clients (one process per slice of the streams) ------------------------------------------------

@dataclass
class Request:
    id: str
    prompt: int  # index into the prompt pool
    max_tokens: int
    submitted: float  # first attempt, so retries count in the latency
    next_seq: int = 0
    tokens: list[int] = field(default_factory=list)
    first_token: float | None = None
    accepted: bool = False  # WebSocket: the gateway answered `accepted`
    last_progress: float = 0.0
    trace: Any = None  # WebSocket: the client's recent frames, for a problem report
    path: str = ""  # websocket | redis


class Tally:
    """What one client process saw."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.failed: Counter[str] = Counter()
        self.lost = self.duplicated = self.stray = 0
        self.wrong_count = self.wrong_tokens = 0
        self.ttft: dict[str, list[float]] = {"websocket": [], "redis": []}  # per path
        self.latency: dict[str, list[float]] = {"websocket": [], "redis": []}
        self.per_path: dict[str, Counter[str]] = {"websocket": Counter(), "redis": Counter()}
        self.unfinished: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []  # a few details of each kind of problem
        self.planned_resumes = self.unplanned_reconnects = self.submit_retries = self.drops = 0
        self.completed = 0

    def bump(self, name: str, n: int = 1, req: Request | None = None) -> None:
        self.progress[COUNTERS.index(name)] += n
        if req is not None:
            self.per_path[req.path][name] += n

    def note(self, kind: str, req: Request, **details: Any) -> None:
        if sum(1 for s in self.samples if s["kind"] == kind) < 10:
            trace = {"trace": list(req.trace)} if req.trace is not None else {}
            self.samples.append({"kind": kind, "id": req.id, "next_seq": req.next_seq, **details, **trace})


class Ctx:
    def __init__(self, cfg: dict[str, Any], progress: Any) -> None:
        self.cfg = cfg
        self.tally = Tally(progress)
        self.prompts: list[list[int]] = cfg["prompts"]
        self.refs: list[list[int]] = cfg["refs"]
        self.stopping = False
        self.stall = cfg["stall_timeout"]
        self.t0 = time.monotonic()

    def new_request(self, rng: random.Random, path: str) -> Request:
        lo, hi = self.cfg["max_tokens"]
        now = time.monotonic()
        return Request(uuid.uuid4().hex, rng.randrange(len(self.prompts)), rng.randint(lo, hi), now,
                       last_progress=now, path=path)

    def params(self, req: Request) -> dict[str, Any]:
        return {"max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True}

    def on_event(self, req: Request, event: dict[str, Any]) -> bool:
        """Check one event of `req`; True when the request is over."""
        t = self.tally
        now = time.monotonic()
        req.last_progress = now
        seq = event.get("seq")
        if not isinstance(seq, int):
            t.note("bad_event", req, event=str(event)[:200])
            return False
        if seq < req.next_seq:
            t.duplicated += 1
            t.bump("duplicated", req=req)
            t.note("duplicate", req, seq=seq)
            return False
        if seq > req.next_seq:
            t.lost += seq - req.next_seq
            t.bump("lost", seq - req.next_seq, req)
            t.note("gap", req, seq=seq)
        req.next_seq = seq + 1
        kind = event.get("type")
        if kind == "token":
            ids = event.get("token_ids") or []
            if ids and req.first_token is None:
                req.first_token = now
            req.tokens.extend(ids)
            return False
        if kind == "error":
            self.fail(req, str(event.get("code")), str(event.get("message")))
            return True
        if kind != "done":
            t.note("bad_event", req, event=str(event)[:200])
            return False
        if event.get("finish_reason") != "length":
            self.fail(req, f"finish_reason={event.get('finish_reason')}")
            return True
        expected = self.refs[req.prompt][:req.max_tokens]
        usage = (event.get("usage") or {}).get("completion_tokens")
        if len(req.tokens) != req.max_tokens or usage != req.max_tokens:
            t.wrong_count += 1
            t.bump("wrong", req=req)
            t.note("wrong_count", req, got=len(req.tokens), usage=usage, want=req.max_tokens)
        elif req.tokens != expected:
            t.wrong_tokens += 1
            t.bump("wrong", req=req)
            first = next(i for i, (a, b) in enumerate(zip(req.tokens, expected)) if a != b)
            t.note("wrong_tokens", req, prompt=req.prompt, first_difference=first)
        t.completed += 1
        t.bump("completed", req=req)
        t.ttft[req.path].append((req.first_token or now) - req.submitted)
        t.latency[req.path].append(now - req.submitted)
        return True

    def fail(self, req: Request, code: str, message: str = "") -> None:
        self.tally.failed[code] += 1
        self.tally.bump("failed", req=req)
        self.tally.note(f"failed:{code}", req, message=message[:300])

    def give_up(self, req: Request, why: str, kind: str, **details: Any) -> None:
        self.tally.bump("unfinished", req=req)
        trace = {"trace": list(req.trace)} if req.trace is not None else {}
        self.tally.unfinished.append({"id": req.id, "client": kind, "why": why, "next_seq": req.next_seq,
                                      "accepted": req.accepted,
                                      "age_s": round(time.monotonic() - req.submitted, 1), **details, **trace})


class WsClient:
    """One WebSocket (a browser tab) running one request after the other through the gateways."""

    kind = "websocket"

    def __init__(self, ctx: Ctx, idx: int) -> None:
        self.ctx, self.rng = ctx, random.Random(ctx.cfg["seed"] * 100_003 + idx)
        self.conn: Any = None
        self.url = ""
        self.req: Request | None = None
        self.dropped = False
        self.trace: deque[str] = deque(maxlen=24)  # the last frames sent and received, for a problem report

    def log(self, what: str) -> None:
        self.trace.append(f"{time.monotonic() - self.ctx.t0:.2f} {self.url[-8:]} {what}"[:160])

    def drop(self) -> bool:
        if self.conn is None or self.req is None:
            return False
        self.dropped = True
        self.conn.transport.abort()  # a network drop: no close frame
        return True

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.ctx.cfg["ramp_s"]))
        try:
            while not self.ctx.stopping:
                self.req = self.ctx.new_request(self.rng, self.kind)
                self.req.trace = self.trace
                self.log(f"new request {self.req.id}")
                await self.request(self.req)
                self.req = None
        finally:
            if self.conn is not None:
                self.conn.transport.abort()

    async def connect(self) -> None:
        from websockets.asyncio.client import connect

        self.url = self.rng.choice(self.ctx.cfg["ws_urls"])
        self.log("connect")
        self.conn = await connect(self.url, compression=None, open_timeout=30, max_queue=None)

    async def request(self, req: Request) -> None:
        from websockets.exceptions import ConnectionClosed, InvalidHandshake

        ctx, t = self.ctx, self.ctx.tally
        mode = "generate"
        backoff = 0.05
        while True:
            if time.monotonic() - req.last_progress > ctx.stall:
                return ctx.give_up(req, f"no frame for {ctx.stall:.0f}s", self.kind)
            try:
                if self.conn is None:
                    await self.connect()
                self.log(f"send {mode} {req.id} after {req.next_seq - 1}")
                if mode == "generate":
                    await self.conn.send(json.dumps({"type": "generate", "id": req.id,
                                                     "prompt_token_ids": ctx.prompts[req.prompt],
                                                     "params": ctx.params(req)}))
                else:
                    await self.conn.send(json.dumps({"type": "resume", "id": req.id,
                                                     "after_seq": req.next_seq - 1}))
                while True:
                    left = ctx.stall - (time.monotonic() - req.last_progress)
                    frame = json.loads(await asyncio.wait_for(self.conn.recv(), timeout=max(left, 0.01)))
                    self.log(f"recv {frame.get('type')} {frame.get('id')} {frame.get('seq', frame.get('code'))}")
                    if frame.get("id") != req.id:  # a frame of an earlier request: never expected
                        t.stray += 1
                        t.per_path[self.kind]["stray"] += 1
                        t.note("stray", req, frame=str(frame)[:200])
                        continue
                    if frame.get("type") == "accepted":
                        req.accepted, req.last_progress = True, time.monotonic()
                        continue
                    if frame.get("type") == "error" and "seq" not in frame:  # the gateway's own error
                        code = frame.get("code")
                        if code == "redis_unavailable":
                            await asyncio.sleep(backoff * self.rng.uniform(0.5, 1.0))
                            backoff = min(2.0, backoff * 2)
                            if mode == "generate":
                                # The gateway forgot the job (its push may or may not have happened):
                                # submit afresh under a new id.
                                t.submit_retries += 1
                                req.id, req.accepted = uuid.uuid4().hex, False
                            break
                        if code == "duplicate_id" and mode == "generate" and req.id:
                            mode = "resume"  # our first generate did reach a gateway: follow it
                            break
                        if code == "already_finished":  # we never saw its final event
                            t.lost += 1
                            t.bump("lost", req=req)
                        if code == "unknown_request" and req.accepted and req.next_seq == 0:
                            # `accepted` promised a queued job, yet nothing under its id exists.
                            return ctx.give_up(req, "accepted, then unknown_request on resume", self.kind)
                        return ctx.fail(req, f"gateway:{code}", str(frame.get("message")))
                    if ctx.on_event(req, frame):
                        return
            except TimeoutError:  # (an OSError too) nothing for --stall-timeout seconds
                if self.conn is not None:  # late frames of this request must not reach the next one
                    self.conn.transport.abort()
                    self.conn = None
                self.log("stalled")
                continue  # the stall check at the top gives up
            except (ConnectionClosed, OSError, InvalidHandshake) as e:
                self.log(f"closed {e!r}")
                if self.conn is not None and not self.dropped:
                    t.unplanned_reconnects += 1
                    t.note("unplanned_reconnect", req, error=repr(e)[:200])
                if self.dropped:
                    t.planned_resumes += 1
                    t.bump("resumes")
                self.conn, self.dropped = None, False
                # A generate with no `accepted` is sent again (a duplicate_id answer turns it into a resume).
                mode = "resume" if req.accepted else "generate"
                await asyncio.sleep(0.05 if isinstance(e, ConnectionClosed) else backoff)
                backoff = min(2.0, backoff * 2)


class RedisClient:
    """A client of the Python AsyncClient, straight to Redis, one request after the other."""

    kind = "redis"

    def __init__(self, ctx: Ctx, idx: int, client: Any) -> None:
        self.ctx, self.client = ctx, client
        self.rng = random.Random(ctx.cfg["seed"] * 100_003 + idx)
        self.req: Request | None = None
        self.reader: asyncio.Task[Any] | None = None

    def drop(self) -> bool:
        if self.reader is None or self.reader.done():
            return False
        self.reader.cancel()  # cuts the XREAD (redis-py closes that connection)
        return True

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.ctx.cfg["ramp_s"]))
        while not self.ctx.stopping:
            self.req = self.ctx.new_request(self.rng, self.kind)
            await self.request(self.req)
            self.req = None

    async def consume(self, req: Request) -> None:
        async for event in self.client.stream(req.id, after_seq=req.next_seq - 1, timeout=self.ctx.stall):
            if self.ctx.on_event(req, event):
                return

    async def request(self, req: Request) -> None:
        from clients.backoff import TRANSIENT

        ctx, t = self.ctx, self.ctx.tally
        while True:
            try:
                # Retries by itself while Redis is away (30 s); the same id again is safe.
                await self.client.submit(prompt_token_ids=ctx.prompts[req.prompt], params=ctx.params(req),
                                         id=req.id)
                req.accepted = True
                break
            except TRANSIENT:
                t.submit_retries += 1
        while True:
            self.reader = asyncio.ensure_future(self.consume(req))
            try:
                await asyncio.wait({self.reader})
            except asyncio.CancelledError:
                self.reader.cancel()
                raise
            reader, self.reader = self.reader, None
            if reader.cancelled():  # dropped: pause a little, then resume after the last seq we hold
                t.planned_resumes += 1
                t.bump("resumes")
                await asyncio.sleep(self.rng.uniform(0.0, 1.0))
                continue
            e = reader.exception()
            if isinstance(e, TimeoutError):
                return ctx.give_up(req, f"no event for {ctx.stall:.0f}s", self.kind)
            if e is not None:
                return ctx.fail(req, f"client:{type(e).__name__}: {e}"[:120])
            return


async def client_main(cfg: dict[str, Any], specs: list[tuple[str, int]], ctrl: Any, progress: Any) -> dict:
    from clients.redis_client import AsyncClient

    ctx = Ctx(cfg, progress)
    redis_clients = {enc: AsyncClient(cfg["redis_url"], encoding=enc) for enc in ("json", "msgpack")}
    clients: list[WsClient | RedisClient] = [
        WsClient(ctx, idx) if kind == "ws" else RedisClient(ctx, idx, redis_clients[("json", "msgpack")[idx % 2]])
        for kind, idx in specs]
    tasks = [asyncio.ensure_future(c.run()) for c in clients]
    drain_s = 0.0
    while True:
        cmd, arg = await asyncio.to_thread(ctrl.get)
        if cmd == "drop":
            for c in random.sample(clients, max(1, round(arg * len(clients)))):
                if c.drop():
                    ctx.tally.drops += 1
                    ctx.tally.bump("drops")
        elif cmd == "stop":
            drain_s = arg
            break
    ctx.stopping = True
    done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
    for c, task in zip(clients, tasks):
        if task in pending and c.req is not None:
            ctx.give_up(c.req, f"not finished {drain_s:.0f}s after the end", c.kind)
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    crashed = [repr(task.exception())[:300] for task in done if not task.cancelled() and task.exception()]
    for client in redis_clients.values():
        await client.aclose()
    t = ctx.tally
    return {"completed": t.completed, "failed": dict(t.failed), "lost": t.lost, "duplicated": t.duplicated,
            "stray": t.stray, "wrong_count": t.wrong_count, "wrong_tokens": t.wrong_tokens, "ttft": t.ttft,
            "latency": t.latency, "unfinished": t.unfinished, "samples": t.samples,
            "per_path": {k: dict(v) for k, v in t.per_path.items()},
            "planned_resumes": t.planned_resumes, "unplanned_reconnects": t.unplanned_reconnects,
            "submit_retries": t.submit_retries, "drops": t.drops, "client_crashes": crashed}


def client_process(cfg: dict[str, Any], specs: list[tuple[str, int]], ctrl: Any, out: Any, progress: Any) -> None:
    import logging

    # The client logs each reconnect while Redis restarts; the tally counts what matters.
    logging.getLogger("streamer.client").setLevel(logging.ERROR)
    try:
        out.put(asyncio.run(client_main(cfg, specs, ctrl, progress)))
    except BaseException as e:  # reported, so the parent does not wait forever
        out.put({"client_crashes": [repr(e)[:300]]})
        raise


# --- the reference: what greedy decoding must produce ------------------------------------------------

def reference_process(ckpt: str, prompts: list[list[int]], max_tokens: int, engine: dict[str, Any], out: Any) -> None:
    from streamer import LLM, SamplingParams

    llm = LLM(model=ckpt, **engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out.put([list(o.outputs[0].token_ids) for o in outs])


def tiny_checkpoint(cache: Path) -> Path:
    from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

    path = cache / "llama-tiny-random"
    if not (path / "config.json").exists():
        build_checkpoint(path, TinyModelSpec(arch="llama"), seed=1)
    return path


# --- the system under test ---------------------------------------------------------------------------

def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class System:
    def __init__(self, args: argparse.Namespace, ckpt: Path, log_dir: Path) -> None:
        from workers.redis_server import RedisServer

        self.args, self.ckpt, self.log_dir = args, ckpt, log_dir
        self.redis = RedisServer(appendonly=True)
        self.workers: list[subprocess.Popen | None] = [None] * args.workers
        self.gateways: list[subprocess.Popen | None] = [None] * args.gateways
        self.gateway_ports: list[int] = []
        self.crashes: list[dict[str, Any]] = []  # processes that died without being killed by us
        self.refused_starts: list[dict[str, Any]] = []  # workers that found Redis away at start-up
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                              os.environ.get("PYTHONPATH")]))}

    def start(self) -> None:
        from workers.redis_server import free_port

        self.redis.start(timeout=60)
        for slot in range(self.args.workers):
            self.start_worker(slot)
        self.wait_workers(self.args.workers, 300)
        self.gateway_ports = [free_port() for _ in range(self.args.gateways)]
        for i in range(self.args.gateways):
            self.start_gateway(i)
        for port in self.gateway_ports:
            self.wait_gateway(port, 60)

    @property
    def ws_urls(self) -> list[str]:
        return [f"ws://127.0.0.1:{port}/ws" for port in self.gateway_ports]

    def _spawn(self, cmd: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen:
        with open(self.log_dir / log_name, "ab") as log:  # the child keeps its own copy
            return subprocess.Popen([sys.executable, "-m", "workers.cli", *cmd], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)

    def start_worker(self, slot: int) -> None:
        a = self.args
        env = {**self.env, "OMP_NUM_THREADS": str(a.worker_threads)}
        self.workers[slot] = self._spawn(
            ["worker", "--model", str(self.ckpt), "--redis", self.redis.url, "--device", "cpu",
             "--max-num-seqs", str(a.max_num_seqs), "--num-kv-blocks", str(a.kv_blocks),
             "--claim-idle", str(a.claim_idle), "--events-ttl", str(a.events_ttl), "--grace", "5",
             "--log-level", "WARNING"], f"worker-{slot}.log", env)

    def start_gateway(self, i: int) -> None:
        self.gateways[i] = self._spawn(
            ["gateway", "--port", str(self.gateway_ports[i]), "--redis", self.redis.url,
             "--request-ttl", str(2 * self.args.events_ttl), "--log-level", "WARNING"],
            f"gateway-{i}.log", self.env)

    def redis_client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis.url, socket_timeout=5, socket_connect_timeout=2)

    def wait_workers(self, n: int, timeout: float) -> None:
        from clients.heartbeats import live_workers

        r = self.redis_client()
        deadline = time.monotonic() + timeout
        try:
            while len(live_workers(r, NAMES)) < n:
                for slot, p in enumerate(self.workers):
                    if p is not None and p.poll() is not None:
                        raise RuntimeError(f"worker {slot} exited during start-up (log: "
                                           f"{self.log_dir / f'worker-{slot}.log'})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fewer than {n} workers alive after {timeout:.0f}s")
                time.sleep(0.2)
        finally:
            r.close()

    def wait_gateway(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway on port {port} not healthy after {timeout:.0f}s")

    def kill_worker(self, slot: int) -> dict[str, Any]:
        p = self.workers[slot]
        assert p is not None
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.start_worker(slot)
        return {"slot": slot, "killed_pid": p.pid, "new_pid": self.workers[slot].pid}  # type: ignore[union-attr]

    def restart_redis(self) -> dict[str, Any]:
        started = time.monotonic()
        self.redis.stop()
        stopped = time.monotonic()
        self.redis.start(timeout=120)  # PING answers only once the AOF is loaded
        return {"stop_s": round(stopped - started, 2), "down_s": round(time.monotonic() - started, 2)}

    def last_log_line(self, name: str) -> str:
        try:
            lines = (self.log_dir / f"{name}.log").read_bytes()[-4000:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def check_alive(self, elapsed: float) -> None:
        """A worker or gateway that died by itself is a finding: recorded, and started again (as a
        supervisor would). A worker that refused to start because Redis was away (it checks once at
        start-up, by design) is recorded apart: that is not a crash."""
        for kind, procs, restart in (("worker", self.workers, self.start_worker),
                                     ("gateway", self.gateways, self.start_gateway)):
            for i, p in enumerate(procs):
                if p is not None and p.poll() is not None:
                    last = self.last_log_line(f"{kind}-{i}")
                    record = {"t": round(elapsed, 1), "process": f"{kind}-{i}", "pid": p.pid,
                              "exit": p.returncode, "last_log_line": last}
                    refused = p.returncode == 2 and "cannot reach Redis" in last
                    (self.refused_starts if refused else self.crashes).append(record)
                    what = "could not reach Redis at start-up" if refused else "exited by itself"
                    print(f"[{elapsed:6.0f}s] !! {kind} {i} (pid {p.pid}) {what} (status {p.returncode}): "
                          f"{last!r}; starting it again", flush=True)
                    restart(i)

    def stop(self) -> None:
        for p in [*self.gateways, *self.workers]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*self.gateways, *self.workers]:
            if p is not None:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.redis.stop()
        self.redis.remove_data()


def sample(system: System, elapsed: float, progress: list[Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"t": round(elapsed, 1)}
    totals = [sum(p[i] for p in progress) for i in range(len(COUNTERS))]
    row.update(dict(zip(COUNTERS, totals)))
    try:
        r = system.redis_client()
        try:
            info = r.info()
            row.update(redis_used_memory=info["used_memory"], redis_rss=info["used_memory_rss"],
                       redis_keys=r.dbsize(), aof_bytes=info.get("aof_current_size"),
                       queued_and_running=r.xlen(NAMES.requests),
                       running=(r.xpending(NAMES.requests, NAMES.group) or {}).get("pending", 0))
        finally:
            r.close()
    except Exception:  # Redis is restarting: this sample has no Redis numbers
        pass
    row["worker_rss"] = [rss_bytes(p.pid if p else None) for p in system.workers]
    row["gateway_rss"] = [rss_bytes(p.pid if p else None) for p in system.gateways]
    return row


def waiting(row: dict[str, Any]) -> Any:
    """Jobs in the requests stream that no worker has read yet."""
    return row["queued_and_running"] - row["running"] if "running" in row else "-"


def diagnose(system: System, rid: str) -> dict[str, Any]:
    """Where an unfinished request stands in Redis: its events, its job entry, its owner."""
    from clients.protocol import decode_event, seq_of_stream_id

    out: dict[str, Any] = {"id": rid}
    try:
        r = system.redis_client()
        try:
            out["events"] = r.xlen(NAMES.events(rid))
            last = r.xrevrange(NAMES.events(rid), count=1)
            if last:
                event = decode_event(last[0][1])
                out["last_event"] = {"seq": seq_of_stream_id(last[0][0]), "type": event.get("type")}
            entry = r.get(NAMES.job(rid))
            out["job_entry"] = entry.decode() if entry else None
            if entry:
                out["entry_in_stream"] = bool(r.xrange(NAMES.requests, entry, entry))
                pend = r.xpending_range(NAMES.requests, NAMES.group, min=entry, max=entry, count=1)
                out["pending"] = [{"consumer": p["consumer"].decode(), "idle_ms": p["time_since_delivered"],
                                   "deliveries": p["times_delivered"]} for p in pend]
            out["fence"] = {k.decode(): v.decode() for k, v in r.hgetall(NAMES.fence(rid)).items()}
        finally:
            r.close()
    except Exception as e:
        out["error"] = repr(e)[:200]
    return out


async def probe(system: System, prompt: list[int], expected: list[int], timeout: float = 60.0) -> list[dict]:
    """After the soak: does each gateway, and Redis directly, still serve a fresh request? One greedy
    request each, retried on `redis_unavailable` until `timeout`; its tokens checked."""
    from websockets.asyncio.client import connect

    from clients.redis_client import AsyncClient

    params = {"max_tokens": len(expected), "temperature": 0.0, "ignore_eos": True}

    async def via_gateway(url: str) -> dict[str, Any]:
        started, attempts, last = time.monotonic(), 0, None
        async with connect(url, compression=None, open_timeout=10) as ws:
            while time.monotonic() - started < timeout:
                attempts += 1
                rid, tokens = uuid.uuid4().hex, []
                await ws.send(json.dumps({"type": "generate", "id": rid, "prompt_token_ids": prompt,
                                          "params": params}))
                while True:
                    left = timeout - (time.monotonic() - started)
                    last = json.loads(await asyncio.wait_for(ws.recv(), timeout=max(left, 0.01)))
                    tokens += last.get("token_ids") or []
                    if last.get("type") in FINAL:
                        break
                if last.get("type") == "done":
                    return {"ok": tokens == expected, "seconds": round(time.monotonic() - started, 2),
                            "attempts": attempts}
                if last.get("code") != "redis_unavailable":
                    break
                await asyncio.sleep(1.0)
        return {"ok": False, "seconds": round(time.monotonic() - started, 2), "attempts": attempts,
                "last_frame": str(last)[:200]}

    async def direct() -> dict[str, Any]:
        started = time.monotonic()
        async with AsyncClient(system.redis.url) as client:
            out = await client.generate(prompt_token_ids=prompt, params=params, timeout=timeout)
        return {"ok": out.token_ids.get(0) == expected, "seconds": round(time.monotonic() - started, 2)}

    async def guarded(name: str, coro: Any) -> dict[str, Any]:
        try:
            return {"path": name, **await asyncio.wait_for(coro, timeout + 15)}
        except Exception as e:
            return {"path": name, "ok": False, "error": repr(e)[:200]}

    jobs = [guarded(f"gateway {i}", via_gateway(url)) for i, url in enumerate(system.ws_urls)]
    return list(await asyncio.gather(*jobs, guarded("redis", direct())))


# --- report ------------------------------------------------------------------------------------------

def slope_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return float("nan")
    xs, ys = [p[0] / 60 for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def trend(series: list[dict[str, Any]], get: Any, duration: float) -> dict[str, Any] | None:
    points = [(s["t"], v) for s in series if (v := get(s)) is not None]
    if not points:
        return None
    values = [v for _, v in points]
    second_half = [p for p in points if duration / 2 <= p[0] <= duration]
    return {"first": values[0], "last": values[-1], "max": max(values), "min": min(values),
            "slope_per_min": slope_per_min([p for p in points if p[0] <= duration]),
            "slope_per_min_2nd_half": slope_per_min(second_half), "samples": len(points)}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"failed": Counter(), "unfinished": [], "samples": [], "client_crashes": [],
                             "ttft": {"websocket": [], "redis": []}, "latency": {"websocket": [], "redis": []},
                             "per_path": {"websocket": Counter(), "redis": Counter()}}
    for part in parts:
        for k, v in part.items():
            if k == "failed":
                total["failed"].update(v)
            elif k in ("ttft", "latency"):
                for path, values in v.items():
                    total[k][path].extend(values)
            elif k == "per_path":
                for path, counts in v.items():
                    total[k][path].update(counts)
            elif isinstance(v, list):
                total[k].extend(v)
            else:
                total[k] = total.get(k, 0) + v
    total["failed"] = dict(total["failed"])
    total["per_path"] = {path: dict(c) for path, c in total["per_path"].items()}
    return total


def mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f}"


def report(args: argparse.Namespace, res: dict[str, Any], series: list[dict[str, Any]], faults: list[dict],
           system: System, probes: list[dict], duration: float, wall: float,
           load: tuple[float, float]) -> tuple[dict[str, Any], bool]:
    def pct(values: list[float], q: float) -> float:
        return round(1e3 * percentile(values, q), 1)

    failed_total = sum(res["failed"].values())
    crashes = system.crashes
    ttft_all = res["ttft"]["websocket"] + res["ttft"]["redis"]
    latency_all = res["latency"]["websocket"] + res["latency"]["redis"]
    trends = {"redis_used_memory": trend(series, lambda s: s.get("redis_used_memory"), duration)}
    if args.workers:
        trends["worker0_rss"] = trend(series, lambda s: s["worker_rss"][0], duration)
        trends["workers_rss_sum"] = trend(series, lambda s: sum(v or 0 for v in s["worker_rss"]), duration)
    for i in range(args.gateways):
        trends[f"gateway{i}_rss"] = trend(series, lambda s, i=i: s["gateway_rss"][i], duration)
    kinds = Counter(f["fault"] for f in faults)
    summary = {
        "requests_completed": res.get("completed", 0),
        "requests_per_s": round(res.get("completed", 0) / duration, 2),
        "requests_failed": failed_total, "failed_by_code": res["failed"],
        "events_lost": res.get("lost", 0), "events_duplicated": res.get("duplicated", 0),
        "stray_frames": res.get("stray", 0),
        "streams_never_finished": len(res["unfinished"]),
        "wrong_token_count": res.get("wrong_count", 0), "wrong_greedy_tokens": res.get("wrong_tokens", 0),
        "ttft_p50_ms": pct(ttft_all, 0.5), "ttft_p99_ms": pct(ttft_all, 0.99),
        "latency_p50_ms": pct(latency_all, 0.5), "latency_p99_ms": pct(latency_all, 0.99),
        "latency_max_ms": round(1e3 * max(latency_all, default=float("nan")), 1),
        "per_path": {path: {**counts, "ttft_p50_ms": pct(res["ttft"][path], 0.5),
                            "ttft_p99_ms": pct(res["ttft"][path], 0.99),
                            "latency_p50_ms": pct(res["latency"][path], 0.5),
                            "latency_p99_ms": pct(res["latency"][path], 0.99)}
                     for path, counts in res["per_path"].items()},
        "planned_resumes": res.get("planned_resumes", 0), "unplanned_reconnects": res.get("unplanned_reconnects", 0),
        "submit_retries": res.get("submit_retries", 0), "clients_dropped": res.get("drops", 0),
        "faults": dict(kinds), "crashed_processes": len(crashes), "client_crashes": res["client_crashes"],
        "worker_starts_refused_redis_away": len(system.refused_starts),
        "served_after_soak": probes,
    }
    bad = bool(summary["events_lost"] or summary["events_duplicated"] or summary["streams_never_finished"]
               or summary["wrong_token_count"] or summary["wrong_greedy_tokens"] or summary["stray_frames"]
               or crashes or res["client_crashes"] or not all(p["ok"] for p in probes))
    ws_n = round(args.streams * args.ws_share)
    downs = [f["down_s"] for f in faults if f["fault"] == "restart_redis"]
    print(f"\nsoak: {args.streams} streams ({ws_n} WebSocket through {args.gateways} gateway(s), "
          f"{args.streams - ws_n} straight to Redis), {args.workers} workers (tiny random Llama, CPU), "
          f"{duration / 60:.1f} min of load, {wall / 60:.1f} min in all, {os.cpu_count()} CPUs "
          f"(load average {load[0]:.1f} before, {load[1]:.1f} at the end)")
    if faults:
        print(f"faults every {args.fault_every:g}s: {kinds.get('kill_worker', 0)} worker SIGKILLs, "
              f"{kinds.get('restart_redis', 0)} Redis restarts (down {statistics.median(downs) if downs else 0:.1f}s "
              f"median), {kinds.get('drop_clients', 0)} client drops ({summary['clients_dropped']} streams cut)")
    else:
        print("no faults injected")
    codes = ", ".join(f"{k}: {v}" for k, v in sorted(res["failed"].items())) or "-"
    rows = [
        ("requests completed", f"{summary['requests_completed']} ({summary['requests_per_s']}/s)"),
        ("requests failed", f"{failed_total} ({codes})"),
        ("events lost (seq gaps)", summary["events_lost"]),
        ("events duplicated (seq seen twice)", summary["events_duplicated"]),
        ("streams never finished", summary["streams_never_finished"]),
        ("wrong outputs (token count / greedy tokens)", f"{summary['wrong_token_count']} / "
                                                         f"{summary['wrong_greedy_tokens']}"),
        ("TTFT p50 / p99", f"{summary['ttft_p50_ms'] / 1e3:.2f} s / {summary['ttft_p99_ms'] / 1e3:.2f} s"),
        ("request latency p50 / p99 / max", f"{summary['latency_p50_ms'] / 1e3:.2f} s / "
                                            f"{summary['latency_p99_ms'] / 1e3:.2f} s / "
                                            f"{summary['latency_max_ms'] / 1e3:.2f} s"),
        ("resumes after a drop / unplanned reconnects", f"{summary['planned_resumes']} / "
                                                         f"{summary['unplanned_reconnects']}"),
        ("submits retried (Redis away)", summary["submit_retries"]),
        ("frames for a request after its final event", summary["stray_frames"]),
        ("processes that crashed by themselves", len(crashes)),
        ("worker restarts refused at start-up (Redis away)", len(system.refused_starts)),
        ("a fresh request served after the soak", ", ".join(
            f"{p['path']}: {'yes' if p['ok'] else 'NO'} ({p.get('seconds', '-')} s)" for p in probes)),
    ]
    print("\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("\n| path | completed | failed | lost | duplicated | never finished | TTFT p50 / p99 | latency p50 / p99 |\n"
          "|---|---|---|---|---|---|---|---|")
    for path, c in summary["per_path"].items():
        print(f"| {path} | {c.get('completed', 0)} | {c.get('failed', 0)} | {c.get('lost', 0)} | "
              f"{c.get('duplicated', 0)} | {c.get('unfinished', 0)} | {c['ttft_p50_ms'] / 1e3:.2f} s / "
              f"{c['ttft_p99_ms'] / 1e3:.2f} s | {c['latency_p50_ms'] / 1e3:.2f} s / "
              f"{c['latency_p99_ms'] / 1e3:.2f} s |")
    print("\n| over time (MB) | first | last | max | slope MB/min (all) | slope MB/min (2nd half) |\n"
          "|---|---|---|---|---|---|")
    for name, tr in trends.items():
        if tr:
            print(f"| {name} | {mb(tr['first'])} | {mb(tr['last'])} | {mb(tr['max'])} | "
                  f"{tr['slope_per_min'] / 2**20:+.2f} | {tr['slope_per_min_2nd_half'] / 2**20:+.2f} |")
    if res["samples"]:
        print("\nproblems seen (first of each kind):")
        for s in res["samples"][:30]:
            print("  ", json.dumps({k: v for k, v in s.items() if k != "trace"}))
    for p in probes:
        if not p["ok"]:
            print(f"  after the soak, {p['path']} did not serve a fresh request: {json.dumps(p)}")
    print("\nRESULT:", "FAIL (events lost or duplicated, streams unfinished, wrong output, a crash, or a "
          "part that no longer serves)" if bad
          else "OK (nothing lost, duplicated or left unfinished)")
    return {"summary": summary, "trends": trends, "ok": not bad}, bad


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
        "num_kv_blocks": args.kv_blocks, "max_num_seqs": args.max_num_seqs, "device": "cpu"}, q))
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
