"""`streamer gateway`: the browsers' door to the Redis worker (docs/gateway.md).

One port serves the WebSocket endpoint `/ws` (jobs in, each request's events out, many requests per
socket), the chat page and its files at `/`, `/healthz` and `/metrics`. The gateway holds no request
state that matters: everything lives in Redis, so a browser that reloads, or reconnects to another
gateway, resumes its answer from the events stream.

Modules: gateway_http (HTTP routes, API keys, origins), gateway_session (one socket: frames, limits,
send queue), gateway_hub (Redis: jobs, cancels, pub/sub relay with gap filling), gateway_metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as ws_serve

from workers.gateway_http import WS_PATH, Routes
from workers.gateway_hub import Hub
from workers.gateway_metrics import Metrics
from workers.gateway_session import Session
from workers.protocol import Limits, Names

log = logging.getLogger("streamer.gateway")

WEB_ROOT = Path(__file__).resolve().parent.parent / "clients" / "web"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests)
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "llm"
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    allowed_origins: tuple[str, ...] = ()  # empty: same origin only; "*": any
    max_frame_bytes: int = 1 << 20  # larger frames get an `error` frame
    max_inflight: int = 16  # requests streaming at once per connection
    max_connections: int = 10000  # open WebSockets; more are refused with HTTP 503
    send_queue_bytes: int = 4 << 20  # per connection, beyond what the socket buffers hold
    cancel_grace_s: float = 10.0  # a closed socket's requests are cancelled after this, unless resumed
    request_ttl_s: float = 3600.0  # lifetime of the gateway's id claims and cancel markers
    idle_poll_s: float = 5.0  # a watched request silent this long has its stream re-read
    close_timeout_s: float = 5.0
    web_root: Path = field(default=WEB_ROOT)

    @property
    def hard_frame_limit(self) -> int:
        """Frames past max_frame_bytes still get a polite error; past this, reading them at all is the
        attack, and websockets closes the socket with 1009."""
        return max(4 * self.max_frame_bytes, 1 << 16)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.names = Names(prefix=config.prefix)
        self.limits = Limits(max_payload_bytes=config.max_frame_bytes)
        self.metrics = Metrics()
        self.hub = Hub(config.redis_url, self.names, self.metrics, ttl_s=config.request_ttl_s,
                       idle_poll_s=config.idle_poll_s)
        self.routes = Routes(config.web_root, config.api_keys, config.allowed_origins, self.health,
                             self.render_metrics, lambda: self.metrics.inc("connections_refused_total"),
                             lambda: len(self.sessions) < config.max_connections)
        self.sessions: set[Session] = set()
        self._pending_cancels: dict[str, asyncio.TimerHandle] = {}
        self.hub.on_resumed = self.keep  # a resume through any gateway stops our grace-period cancel
        self.server: Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None, "gateway not started"
        return self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}/"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.config.host}:{self.port}{WS_PATH}"

    async def start(self) -> None:
        await self.hub.start()
        try:
            self.server = await ws_serve(
                self._handle, self.config.host, self.config.port,
                process_request=self.routes.process_request,
                max_size=self.config.hard_frame_limit,
                compression=None,  # token frames are tiny; deflate would cost CPU for nothing
                close_timeout=self.config.close_timeout_s,
                server_header="streamer-gateway",
            )
        except BaseException:
            await self.hub.close()
            raise
        log.info("gateway on %s (WebSocket %s), Redis prefix %r", self.url, self.ws_url, self.config.prefix)

    async def close(self) -> None:
        """Shut down without cancelling anything: clients reconnect (here or to another gateway) and
        resume, so a restart does not cost anyone their answer."""
        for handle in self._pending_cancels.values():
            handle.cancel()
        self._pending_cancels.clear()
        if self.server is not None:
            self.server.close()  # closes open connections too (1001 going away)
            await self.server.wait_closed()
        await self.hub.close()

    async def _handle(self, ws: ServerConnection) -> None:
        session = Session(ws, self)
        self.sessions.add(session)
        self.metrics.inc("connections_total")
        try:
            await session.run()
        finally:
            self.sessions.discard(session)

    # --- grace-period cancel -----------------------------------------------------------------------

    def cancel_later(self, request_id: str) -> None:
        """A socket closed with this request unfinished: free its KV blocks unless someone resumes it."""
        if self.server is None or not self.server.is_serving():
            return  # shutting down: see close()
        if self.config.cancel_grace_s <= 0:
            self._cancel_now(request_id)
            return
        self.keep(request_id)
        loop = asyncio.get_running_loop()
        self._pending_cancels[request_id] = loop.call_later(self.config.cancel_grace_s, self._cancel_now,
                                                            request_id)

    def keep(self, request_id: str) -> None:
        handle = self._pending_cancels.pop(request_id, None)
        if handle is not None:
            handle.cancel()

    def _cancel_now(self, request_id: str) -> None:
        self._pending_cancels.pop(request_id, None)
        if any(request_id in s.requests for s in self.sessions):
            return  # resumed on another socket meanwhile
        self.metrics.inc("grace_cancels_total")
        self.hub.spawn(self.hub.cancel(request_id), f"cancel {request_id} after its socket closed")

    # --- HTTP --------------------------------------------------------------------------------------

    async def health(self) -> tuple[bool, dict[str, Any]]:
        redis_ok = await self.hub.ping()
        workers: list[dict[str, str]] = []
        if redis_ok:
            with contextlib.suppress(Exception):
                workers = await asyncio.wait_for(self.hub.workers(), timeout=2)
        ok = redis_ok and bool(workers)
        return ok, {"ok": ok, "redis": redis_ok, "workers": workers,
                    "connections": len(self.sessions)}

    def render_metrics(self) -> str:
        self.metrics.values["connections_open"] = len(self.sessions)
        self.metrics.values["requests_inflight"] = sum(len(s.requests) for s in self.sessions)
        return self.metrics.render()


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig) -> AsyncIterator[Gateway]:
    """A started gateway for in-process use (tests, `streamer up`): `async with running_gateway(c) as gw`."""
    gw = Gateway(config)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.close()


async def serve(config: GatewayConfig, started: asyncio.Event | None = None) -> None:
    """Run until cancelled (or SIGINT/SIGTERM when run from the CLI)."""
    async with running_gateway(config):
        if started is not None:
            started.set()
        await asyncio.Event().wait()


# --- CLI -------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    parser.add_argument("--host", default=d.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=d.port, help="port for /ws, the chat page, /healthz, /metrics")
    parser.add_argument("--redis", default=d.redis_url, help="Redis URL (redis://[:PASSWORD@]HOST:PORT/DB)")
    parser.add_argument("--prefix", default=d.prefix, help="prefix of every Redis key (as the worker's)")
    parser.add_argument("--api-key", action="append", default=None, dest="api_key",
                        help="accept this API key (repeat for several); none given: no key needed")
    parser.add_argument("--api-keys-file", type=Path, default=None,
                        help="file with one API key per line (# comments allowed)")
    parser.add_argument("--allowed-origin", action="append", default=None, dest="allowed_origin",
                        help="origin allowed to open /ws, e.g. https://chat.example.com (repeatable; "
                             "'*' allows any); none given: only the gateway's own page")
    parser.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes,
                        help="largest client frame accepted")
    parser.add_argument("--max-inflight", type=int, default=d.max_inflight,
                        help="requests streaming at once per connection")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="open WebSockets; more are refused with HTTP 503")
    parser.add_argument("--send-queue-bytes", type=int, default=d.send_queue_bytes,
                        help="per-connection bound on unsent frames; a slower reader is closed (code 4008)")
    parser.add_argument("--cancel-grace", type=float, default=d.cancel_grace_s,
                        help="seconds a closed socket's requests wait for a resume before being "
                             "cancelled (0: at once)")
    parser.add_argument("--request-ttl", type=float, default=d.request_ttl_s,
                        help="seconds the gateway's id claims and cancel markers live in Redis")
    parser.add_argument("--web-root", type=Path, default=d.web_root, help="directory of the chat page")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _read_keys(path: Path | None) -> list[str]:
    if path is None:
        return []
    from workers.errors import UserError

    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read --api-keys-file {path}: {e.strerror}") from e
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    keys = [*(k for k in (args.api_key or []) if k), *_read_keys(args.api_keys_file)]
    return GatewayConfig(host=args.host, port=args.port, redis_url=args.redis, prefix=args.prefix,
                         api_keys=tuple(keys), allowed_origins=tuple(args.allowed_origin or ()),
                         max_frame_bytes=args.max_frame_bytes, max_inflight=args.max_inflight,
                         max_connections=args.max_connections,
                         send_queue_bytes=args.send_queue_bytes, cancel_grace_s=args.cancel_grace,
                         request_ttl_s=args.request_ttl, web_root=args.web_root)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # websockets logs every HTTP response (health probes, page loads) at INFO.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.getLogger().level))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with running_gateway(config) as gw:
            print(f"streamer gateway: chat page {gw.url} (WebSocket {gw.ws_url})", flush=True)
            await stop.wait()
            log.info("stopping: open sockets are closed, their requests keep running for a resume")

    asyncio.run(main())
    return 0
