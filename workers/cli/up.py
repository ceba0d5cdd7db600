"""`streamer up`: everything on one machine, no Docker.

Phases, each timed: Redis (a private redis-server on a free port, unless --redis URL), the model
(the built-in SmolLM2 is converted on first run), one worker on the best device (it picks it), and the
gateway, started while the worker loads the model.
Then it prints the chat page URL and waits. Ctrl-C (or SIGTERM/SIGHUP) stops the gateway and the
worker (the gateway ends its open streams at once: a final SSE event, a close frame), then Redis,
and exits.

Worker and gateway are child processes started in their own sessions: the terminal's Ctrl-C
reaches only this process, which stops them in order (the gateway before the Redis it talks to);
a second Ctrl-C kills them at once. Should this process die without stopping them (SIGKILL), they
follow: worker and gateway watch their parent (parent.py), and the kernel stops the private
redis-server (parent-death signal). Any other STREAMER_* variable in the environment reaches them too, e.g.
`STREAMER_MAX_MODEL_LEN=2048 streamer up`.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from clients.errors import redact_url
from clients.heartbeats import live_workers
from clients.protocol import Names
from workers import up_state
from workers.arg_types import optional_port, port_number, redis_url
from workers.cli.compiling import compiling
from workers.cli.processes import Child, Phases
from workers.errors import UserError
from workers.ports import check_port_free
from workers.progress_display import task
from workers.redis_options import check_redis, sync_client
from workers.redis_server import RedisServer, free_port

WORKER_GRACE_S = 3.0  # < processes.STOP_TIMEOUT_S: the worker exits by itself before being killed
KERNELS = "compiling the CPU kernels (first start only: minutes on a small CPU, then reused)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face checkpoint directory of a supported family (README: Supported "
                             "models), or a llama.cpp .gguf file (converted once); default: the built-in "
                             "SmolLM2-135M-Instruct, prepared on first run")
    parser.add_argument("--redis", type=redis_url, default=None,
                        help="URL of a running Redis to use; default: start a private redis-server "
                             "on a free port")
    parser.add_argument("--prefix", default="llm", help="prefix of every Redis name (worker and gateway)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="let the gateway serve without an API key on a non-loopback --host (passed on "
                             "to `streamer gateway`; a key comes from STREAMER_API_KEY)")
    parser.add_argument("--port", type=port_number, default=8000, help="gateway port (0: any free port)")
    parser.add_argument("--device", default=None, help="device for the worker: cpu, cuda or cuda:N "
                                                       "(default: CUDA if available, else CPU)")
    # (no choices here: STREAMER_DTYPE means the same to `worker`, which checks the value)
    parser.add_argument("--dtype", default=None,
                        help="the worker's weights and compute: float32, bfloat16 or float16 (default: the "
                             "checkpoint's on GPU; on CPU bfloat16 where it has AVX-512 BF16 or AMX, else float32)")
    parser.add_argument("--metrics-port", type=optional_port, default=0,
                        help="the worker serves Prometheus metrics on this port (vLLM's names; 0: off)")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for the worker to load the model")


class _Stop(Exception):
    """SIGTERM/SIGHUP: stop like Ctrl-C."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


# --- checks -----------------------------------------------------------------------------------

def worker_names(url: str, prefix: str) -> set[str]:
    """Consumer names of the workers alive on this Redis, from the heartbeat set (no key scan)."""
    cluster = check_redis(url)
    client = sync_client(url, cluster=cluster)
    try:
        return set(live_workers(client, Names(prefix=prefix, cluster=cluster)))
    finally:
        client.close()


def worker_device(url: str, prefix: str, name: str) -> str:
    """The device and dtype a live worker runs on (its heartbeat's stats hash), "cpu, bfloat16";
    "" when not known."""
    cluster = check_redis(url)
    client = sync_client(url, cluster=cluster)
    try:
        device, dtype = client.hmget(Names(prefix=prefix, cluster=cluster).worker(name), ["device", "dtype"])
        return ", ".join(v.decode() for v in (device, dtype) if v)
    finally:
        client.close()


def wait_until(ready: Callable[[], bool], children: list[Child], timeout: float, what: str,
               tick_s: float = 10.0, doing: Callable[[], str | None] = lambda: None) -> None:
    """Poll `ready` until it holds; fail if a child exits or the timeout passes. A spinner with the
    elapsed time on a terminal, a line every `tick_s` otherwise; both say `doing()` instead of `what`
    while it names a step (asked once a second)."""
    start = last_tick = last_look = time.monotonic()
    now_doing = what
    with task(f"      {what}", summary=False) as shown:
        while not ready():
            for child in children:
                code = child.exited()
                if code is not None:
                    raise UserError(f"the {child.name} exited with status {code} while {what} "
                                    "(its messages are above)")
            now = time.monotonic()
            if now - start > timeout:
                raise UserError(f"gave up after {timeout:.0f}s {what}: raise --startup-timeout if the "
                                "machine is just slow")
            if now - last_look >= 1.0:
                last_look, step = now, doing() or what
                if step != now_doing:
                    now_doing = step
                    shown.update(description=f"      {step}")
            if not shown.drawn and now - last_tick >= tick_s:
                print(f"      ... still {now_doing} ({now - start:.0f}s)", flush=True)
                last_tick = now
            time.sleep(0.2)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


# --- run --------------------------------------------------------------------------------------

@dataclass
class Started:
    """What `up` started, stopped by `_shutdown` (children in reverse order, then Redis)."""

    redis_server: RedisServer | None = None
    children: list[Child] = field(default_factory=list)

    def start(self, child: Child) -> Child:
        self.children.append(child)  # before start(), so that a Ctrl-C in between stops it too
        return child.start()


@dataclass(frozen=True)
class Setup:
    redis_url: str
    model: str
    device: str
    host: str  # the address a browser on this machine uses
    port: int


def run(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    check_port_free(args.host, port)
    # The address a browser on this machine uses (an IPv6 literal goes in brackets in a URL).
    local_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    local_host = f"[{local_host}]" if ":" in local_host else local_host
    started = Started()
    old_handlers = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        phases = Phases()
        setup = _start_all(args, local_host, port, phases, started)
        up_state.record(setup.redis_url, args.prefix, f"http://{local_host}:{port}/")
        _print_banner(setup, phases, args.metrics_port)
        return _wait_for_exit(started.children)
    except (KeyboardInterrupt, _Stop):
        print("\nstopping ...", flush=True)
        return 0
    finally:
        up_state.forget()
        _shutdown(started.children, started.redis_server)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _start_all(args: argparse.Namespace, local_host: str, port: int, phases: Phases,
               started: Started) -> Setup:
    """The four phases, each started process recorded in `started` as soon as it exists."""
    with phases.phase("redis", "Redis" + (f" at {redact_url(args.redis)}" if args.redis else
                                          ": starting a private redis-server")):
        redis_url = _start_redis(args.redis, started)

    with phases.phase("model", "Model: " + (args.model or "built-in SmolLM2-135M-Instruct")):
        from workers.default_model import resolve_model

        model = str(resolve_model(args.model, progress=lambda m: print("      " + m.strip(), flush=True)))

    # The Redis URL goes by environment, not argv: a password in it stays out of `ps`.
    # On Ctrl-C the gateway is already gone when the worker stops: nobody reads the rest of its
    # answers now, so it need not wait long for them (unless STREAMER_GRACE says otherwise); with a
    # private Redis, removed right after, nobody ever will: it stops at once.
    grace = 0.0 if started.redis_server is not None else WORKER_GRACE_S
    child_env = {"STREAMER_REDIS": redis_url, "STREAMER_GRACE": os.environ.get("STREAMER_GRACE") or str(grace)}
    with phases.phase("worker", "Worker: loading the model" + (f" on {args.device}" if args.device else "")):
        # With a shared Redis other workers may be there already: wait for a new heartbeat.
        before = worker_names(redis_url, args.prefix)
        # The worker picks the best device itself: importing torch here would cost a second.
        metrics = ["--metrics-port", str(args.metrics_port), "--metrics-host", args.host] if args.metrics_port else []
        worker = started.start(Child("worker", ["worker", "--model", model, "--prefix", args.prefix,
                                                *(["--device", args.device] if args.device else []),
                                                *(["--dtype", args.dtype] if args.dtype else []), *metrics],
                                     env=child_env))
        # The gateway needs no worker to start: it comes up while the model loads.
        started.start(Child("gateway", ["gateway", "--host", args.host, "--port", str(port),
                                        "--prefix", args.prefix,
                                        *(["--insecure-no-auth"] if args.insecure_no_auth else [])],
                            env=child_env))
        new: list[str] = []

        def worker_step() -> str | None:  # the first start on CPU builds the kernels: say so
            return KERNELS if worker.proc is not None and compiling(worker.proc.pid) else None

        def worker_ready() -> bool:
            new[:] = sorted(worker_names(redis_url, args.prefix) - before)
            return bool(new)

        wait_until(worker_ready, started.children, args.startup_timeout, "loading the model", doing=worker_step)
        device = worker_device(redis_url, args.prefix, new[0]) or args.device or "?"
        print(f"      on {device}", flush=True)

    with phases.phase("gateway", f"Gateway on {args.host}:{port} (started beside the worker)"):
        wait_until(lambda: http_status(f"http://{local_host}:{port}/healthz") == 200,
                   started.children, 60.0, "starting the gateway")
    return Setup(redis_url, model, device, local_host, port)


def _start_redis(url: str | None, started: Started) -> str:
    """The URL of the Redis to use: the one given (checked), or a private server's."""
    if url:
        check_redis(url)
        return url
    # Assigned before start(): a Ctrl-C during start() must still stop it.
    started.redis_server = RedisServer(new_session=True, die_with_parent=True)
    started.redis_server.start()
    print(f"      {started.redis_server.url}", flush=True)
    return started.redis_server.url


def _print_banner(setup: Setup, phases: Phases, metrics_port: int = 0) -> None:
    host, port, redis_url = setup.host, setup.port, redact_url(setup.redis_url)
    print(f"\nstreamer is up in {phases.summary()}\n"
          f"  chat page:  http://{host}:{port}/\n"
          f"  WebSocket:  ws://{host}:{port}/ws\n"
          f"  OpenAI API: http://{host}:{port}/v1\n"
          f"  Redis:      {redis_url}\n"
          + (f"  metrics:    http://{host}:{metrics_port}/metrics (the worker's)\n" if metrics_port else "") +
          f"  model:      {setup.model} on {setup.device}\n"
          "  try:        streamer generate --chat 'What is the capital of France?'   (it finds this Redis)\n"
          "Press Ctrl-C to stop.", flush=True)


def _wait_for_exit(children: list[Child]) -> int:
    """Until a child exits on its own (Ctrl-C and SIGTERM/SIGHUP raise instead)."""
    while True:
        for child in children:
            code = child.exited()
            if code is not None:
                print(f"the {child.name} exited with status {code}: stopping", flush=True)
                return 1
        time.sleep(0.5)


def _shutdown(children: list[Child], redis_server: RedisServer | None) -> None:
    """Gateway and worker together (one after the other, their exits would add up), then Redis they
    both talk to; a second Ctrl-C kills at once."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        for child in reversed(children):  # the gateway first: it takes no new job from then on
            child.ask_to_stop()
        for child in reversed(children):
            child.stop()
    except KeyboardInterrupt:
        print("killing ...", flush=True)
    # From here on nothing may interrupt the cleanup (it is quick): no orphan process or port.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for child in children:
            child.kill()
        if redis_server is not None:
            redis_server.stop()
            redis_server.remove_data()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    print("stopped", flush=True)
