"""The soak's load: client processes, each running a slice of the streams over a gateway's
WebSocket or straight over Redis, checking every event as it arrives (bench/soak.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from clients.protocol import Names

NAMES = Names()
FINAL = ("done", "error")
# Progress counters each client process keeps in shared memory (the parent prints them live).
COUNTERS = ("completed", "failed", "lost", "duplicated", "unfinished", "wrong", "drops", "resumes")


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
