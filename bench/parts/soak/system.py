"""The soak's system under test (a private redis-server, workers, gateways, each its own process),
the reference outputs it must produce, its samples and the probes after the run (bench/soak.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.harness.machine import ROOT, rss_bytes
from bench.harness.servers import child_env, stop_all
from bench.parts.soak.clients import COUNTERS, FINAL, NAMES

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
        self.env = child_env(keep_streamer_vars=True)

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
            # float32, as the reference: greedy tokens are exact only where the batch cannot change the
            # arithmetic, and bfloat16 (the default where the CPU has it) rounds differently per batch.
            ["worker", "--model", str(self.ckpt), "--redis", self.redis.url, "--device", "cpu", "--dtype", "float32",
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
        stop_all([p for p in [*self.gateways, *self.workers] if p is not None])
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
