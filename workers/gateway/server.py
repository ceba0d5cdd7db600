"""The gateway server: the browsers' door to the Redis worker (docs/gateway.md).

One port serves the WebSocket endpoint `/ws` (jobs in, each request's events out, many requests per
socket), the chat page and its files at `/`, `/livez`, `/readyz` (and `/healthz`, the same as
`/readyz`) and `/metrics`. The gateway holds no request
state that matters: everything lives in Redis, so a browser that reloads, or reconnects to another
gateway, resumes its answer from the events stream.

`Gateway` wires the parts of this package into one Starlette app served by uvicorn: routes.py (HTTP,
API keys, origins), openai/routes.py (the OpenAI-compatible API), session.py (one socket: frames,
limits, send queue; it gets the hub, the metrics and the grace-period cancels passed in), hub.py
(Redis: jobs, cancels, pub/sub relay with gap filling), tenants.py (the keys' tenants and their
limits, checked in Redis before each push), metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.websockets import WebSocket
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from clients.errors import ProtocolError
from clients.protocol import Limits, Names
from workers.errors import UserError
from workers.gateway.batch_runner import BatchRunner
from workers.gateway.config import GatewayConfig
from workers.gateway.http_protocol import with_header_deadline
from workers.gateway.hub import Hub
from workers.gateway.metrics import Metrics
from workers.gateway.openai.jobs import JobStream
from workers.gateway.openai.routes import OpenAIRoutes
from workers.gateway.routes import WS_PATH, Routes, request_token
from workers.gateway.session import Session
from workers.gateway.socket_conn import SocketConn, with_transport
from workers.gateway.tenants import TenantGate
from workers.redis_options import pool_url

log = logging.getLogger("streamer.gateway")
SHARES_EVERY_S = 60.0  # the tenants' shares are written again this often (a Redis that lost them)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.names = Names(prefix=config.prefix, cluster=config.cluster, shards=config.request_shards,
                           lanes=config.priority_lanes)
        self.limits = Limits(max_payload_bytes=config.max_frame_bytes)
        self.metrics = Metrics()
        # The pool's bound travels in the URL's query (redis-py reads it there).
        redis_url = pool_url(config.redis_url, config.redis_max_connections, config.redis_pool_timeout_s)
        self.hub = Hub(redis_url, self.names, self.metrics, ttl_s=config.request_ttl_s,
                       idle_poll_s=config.idle_poll_s, routing=config.routing)
        # Tenants' limits, checked in Redis before every push of a job that has a tenant.
        self.gate = TenantGate(self.hub.redis, self.names, config.tenants, self.metrics, config.request_ttl_s)
        self.routes = Routes(config.web_root, config.api_keys, config.allowed_origins, self.health,
                             self.metrics.render, lambda: self.metrics.inc("connections_refused_total"),
                             lambda: len(self.sessions) < config.max_connections, live=self.live)
        self.started = time.monotonic()
        self.started_wall = time.time()
        # The longest context a live worker announced in its heartbeat (0: none did); refreshed by
        # every readiness check and by a background loop.
        self.workers_max_model_len = 0
        self.workers_alive: int | None = None  # live workers at the last look (None: not looked yet)
        self._watch_workers: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.sessions: set[Session] = set()
        # Read at each scrape: nothing to keep up to date on the hot path.
        self.metrics.track("connections_open", lambda: len(self.sessions))
        self.metrics.track("requests_inflight", lambda: sum(len(s.requests) for s in self.sessions))
        self.metrics.open_connections("ws").set_function(lambda: len(self.sessions))
        self._pending_cancels: dict[str, asyncio.TimerHandle] = {}
        self.hub.relay.on_resumed = self.keep  # a resume through any gateway stops our grace-period cancel
        # Requests streaming to HTTP clients now (request id -> count), for the grace cancel's check.
        self.http_streams: dict[str, int] = {}
        self.draining = asyncio.Event()  # whole (non-streamed) HTTP answers end with 503 when set
        self.sse_streams: set[JobStream] = set()  # SSE answers now: each told at once on shutdown
        self.openai = OpenAIRoutes(self)
        self.batch_runner = BatchRunner(self)  # advances the Batch API's batches, with any other gateway
        self.app = Starlette(routes=[*self.routes.routes(self._handle), *self.openai.routes(),
                                     Route("/{path:path}", self.routes.static, methods=["GET", "HEAD"])])
        self.server: _Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.serving = False

    @property
    def port(self) -> int:
        assert self._sock is not None, "gateway not started"
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}/"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.config.host}:{self.port}{WS_PATH}"

    async def start(self) -> None:
        if self.config.open_to_all:
            if not self.config.insecure_no_auth:
                raise UserError(f"refusing to serve on {self.config.host or 'all interfaces'} without an API "
                                "key: anyone who reaches the port could use it. Pass --api-key KEY (or "
                                "STREAMER_API_KEY, --api-keys-file FILE), listen on 127.0.0.1, or pass "
                                "--insecure-no-auth (STREAMER_INSECURE_NO_AUTH=1) if that is really what you want")
            log.warning("INSECURE: listening on %s:%s with no API key (--insecure-no-auth): anyone who can "
                        "reach this port can submit jobs and read or cancel any request whose id they know",
                        self.config.host or "*", self.config.port)
        await self.hub.start()
        try:
            await self.gate.register_shares()  # before the first job: workers share by them
            await self._serve()
        except BaseException:
            await self.hub.close()
            raise
        # The prompt limit (unless --max-prompt-tokens) and whether anyone serves at all (`accepted`
        # frames say how many workers are alive) are learned from the heartbeats.
        self._watch_workers = asyncio.create_task(self._workers_loop())
        self.hub.spawn(self.batch_runner.run(), "batch runner")  # ends with the hub (close)
        self.hub.spawn(self.openai.responses.sweeper.run(), "responses sweeper")  # stores finished responses
        log.info("gateway on %s (WebSocket %s), Redis prefix %r", self.url, self.ws_url, self.config.prefix)

    async def close(self) -> None:
        """Shut down without cancelling anything: clients reconnect (here or to another gateway) and
        resume, so a restart does not cost anyone their answer."""
        self.serving = False
        self.draining.set()
        for handle in self._pending_cancels.values():
            handle.cancel()
        self._pending_cancels.clear()
        # No new connections first (a client reconnecting now is refused, not half-served), then 1001
        # going away to every socket (uvicorn's own shutdown would say 1012).
        for listener in getattr(self.server, "servers", []):
            listener.close()
        for stream in list(self.sse_streams):  # each ends with a `shutting_down` event, then closes
            stream.end_now()
        await asyncio.gather(*(s.close(1001, "gateway shutting down") for s in list(self.sessions)),
                             return_exceptions=True)
        if self.server is not None and self._serve_task is not None:
            self.server.should_exit = True
            await asyncio.wait({self._serve_task}, timeout=self.config.close_timeout_s + 5)
        self._stopping.set()
        if self._watch_workers is not None:
            self._watch_workers.cancel()
            await asyncio.wait({self._watch_workers}, timeout=self.config.close_timeout_s)
        await self.hub.close()

    async def _serve(self) -> None:
        """uvicorn on a socket bound here (port 0 picks a free one; a busy port raises OSError)."""
        self._sock = _listen(self.config.host, self.config.port)
        config = uvicorn.Config(
            functools.partial(with_transport, self.app), interface="asgi3", log_config=None, access_log=False,
            lifespan="off", ws="websockets-sansio",
            http=with_header_deadline(AutoHTTPProtocol, self.config.header_timeout_s),
            ws_max_size=self.config.hard_frame_limit,
            ws_per_message_deflate=False,  # token frames are tiny; deflate would cost CPU for nothing
            server_header=False, headers=[("server", "streamer-gateway")],
            timeout_graceful_shutdown=max(1, int(self.config.close_timeout_s)),
            limit_concurrency=None, backlog=2048)
        self.server = _Server(config)
        self._serve_task = asyncio.create_task(self.server.serve(sockets=[self._sock]))
        while not self.server.started:
            if self._serve_task.done():  # failed to start: its exception, or a plain error
                self._serve_task.result()
                raise RuntimeError("the gateway's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.serving = True

    async def _handle(self, starlette_ws: WebSocket) -> None:
        ws = SocketConn(starlette_ws)
        # The handshake passed the key check: its key's tenant is every job's on this socket.
        session = Session(ws, self.config, self.hub, self.metrics, self.limits, self, self.prompt_limit,
                          lambda: self.workers_alive, gate=self.gate,
                          tenant=self.config.tenant_of(request_token(starlette_ws)))
        self.sessions.add(session)
        self.metrics.inc("connections_total")
        try:
            await session.run()
        finally:
            self.sessions.discard(session)

    # --- grace-period cancel -----------------------------------------------------------------------

    def cancel_later(self, request_id: str, since_ms: float) -> None:
        """A socket closed with this request unfinished: free its KV blocks unless someone resumes it
        (here, or on another gateway since `since_ms`: that resume may even come before we noticed
        the close, so its pub/sub notice alone can miss our timer)."""
        if not self.serving:
            return  # shutting down: see close()
        if self.config.cancel_grace_s <= 0:
            self._cancel_now(request_id, since_ms)
            return
        self.keep(request_id)
        loop = asyncio.get_running_loop()
        self._pending_cancels[request_id] = loop.call_later(self.config.cancel_grace_s, self._cancel_now,
                                                            request_id, since_ms)

    def keep(self, request_id: str) -> None:
        handle = self._pending_cancels.pop(request_id, None)
        if handle is not None:
            handle.cancel()

    def _cancel_now(self, request_id: str, since_ms: float) -> None:
        self._pending_cancels.pop(request_id, None)
        if any(request_id in s.requests for s in self.sessions) or request_id in self.http_streams:
            return  # resumed on another socket or HTTP stream meanwhile
        self.hub.spawn(self._grace_cancel(request_id, since_ms), f"cancel {request_id} after its socket closed")

    async def _grace_cancel(self, request_id: str, since_ms: float) -> None:
        try:
            if await self.hub.resumed_since(request_id, since_ms):
                log.info("request %s: resumed through another gateway, not cancelled", request_id)
                return
            self.metrics.inc("grace_cancels_total")
            await self.hub.cancel(request_id)
        except ProtocolError as e:  # its keys expired meanwhile: nothing left to cancel
            log.info("request %s: not cancelled after its socket closed: %s", request_id, e.message)

    # --- HTTP --------------------------------------------------------------------------------------

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness (`/readyz`, `/healthz`): Redis answers, the pub/sub connection that relays every
        event is live, and at least one worker is alive."""
        redis_ok = await self.hub.ping()
        pubsub_ok = self.hub.relay.ready
        workers: list[dict[str, str]] = []
        if redis_ok:
            with contextlib.suppress(Exception):
                workers = await asyncio.wait_for(self.hub.workers(), timeout=2)
                self._learn(workers)
        ok = redis_ok and pubsub_ok and bool(workers)
        return ok, {"ok": ok, "redis": redis_ok, "pubsub": pubsub_ok, "workers": workers,
                    "connections": len(self.sessions)}

    def live(self) -> dict[str, Any]:
        """Liveness (`/livez`): this process serves HTTP. Asks nothing of Redis or the workers, so a
        worker still loading its model, or Redis restarting, never reads as a dead gateway."""
        return {"ok": True, "connections": len(self.sessions),
                "uptime_s": round(time.monotonic() - self.started, 1)}

    # --- what the workers can take -----------------------------------------------------------------

    def prompt_limit(self) -> int:
        """Longest `prompt_token_ids` to push: --max-prompt-tokens, else what the workers announce (a
        prompt of max_model_len tokens leaves no room for an answer), else 0 (no check)."""
        if self.config.max_prompt_tokens > 0:
            return self.config.max_prompt_tokens
        return max(0, self.workers_max_model_len - 1)

    def _learn(self, workers: list[dict[str, str]]) -> None:
        lens = [int(w["max_model_len"]) for w in workers if str(w.get("max_model_len", "")).isdigit()]
        self.workers_max_model_len = max(lens, default=0)
        self.workers_alive = len(workers)

    async def _workers_loop(self, every_s: float = 5.0) -> None:
        # Ends on `_stopping`, not only on cancel: a cancel that lands inside a Redis call can be
        # swallowed there (seen with redis-py on Python 3.11), and close() must never hang on it.
        shares_at = time.monotonic()
        while not self._stopping.is_set():
            with contextlib.suppress(Exception):  # Redis away: keep the last known value
                self._learn(await self.hub.workers())
            if time.monotonic() - shares_at >= SHARES_EVERY_S:
                with contextlib.suppress(Exception):  # Redis away: the next round writes them
                    await self.gate.register_shares()
                    shares_at = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), every_s)


class _Server(uvicorn.Server):
    """uvicorn inside our event loop: the gateway's owner handles signals, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig) -> AsyncIterator[Gateway]:
    """A started gateway (`streamer gateway`, tests): `async with running_gateway(config) as gw`."""
    gw = Gateway(config)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.close()
