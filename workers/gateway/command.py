"""`streamer gateway`: run the gateway (server.py) from the command line until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from clients.routing import POLICIES
from workers.arg_types import port_number, priority_lanes, redis_url
from workers.gateway.config import GatewayConfig
from workers.gateway.keys_file import KeysFile, read_keys_file
from workers.gateway.server import running_gateway
from workers.redis_options import add_pool_arguments, check_redis

log = logging.getLogger("streamer.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    parser.add_argument("--host", default=d.host, help="address to listen on")
    parser.add_argument("--port", type=port_number, default=d.port,
                        help="port for /ws, /v1 (OpenAI API), the chat page, /healthz, /metrics")
    parser.add_argument("--redis", type=redis_url, default=d.redis_url,
                        help="Redis URL (redis://[:PASSWORD@]HOST:PORT/DB)")
    parser.add_argument("--prefix", default=d.prefix, help="prefix of every Redis key (as the worker's)")
    parser.add_argument("--request-shards", type=int, default=d.request_shards,
                        help="request streams jobs are spread over (as the workers')")
    parser.add_argument("--priority-lanes", type=priority_lanes, default=d.priority_lanes,
                        help="negative priority cutoffs, e.g. -10,-1: a job of priority <= a cutoff waits in "
                             "that urgent lane, taken before any job of a less urgent one (docs/scheduling.md)")
    parser.add_argument("--routing", choices=POLICIES, default=d.routing,
                        help="with several workers, send a job to the worker holding its session or a long "
                             "prefix of its prompt (cache_load; shared: never)")
    add_pool_arguments(parser)
    parser.add_argument("--api-key", action="append", default=None, dest="api_key",
                        help="accept this API key (repeat for several); none given: no key needed")
    parser.add_argument("--api-keys-file", type=Path, default=None,
                        help="file with one API key per line (# comments allowed), or JSON/TOML naming "
                             "tenants (share, max_concurrent, tokens_per_minute, min_priority) and each key's tenant "
                             "(docs/gateway.md#tenants)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve without an API key on a non-loopback --host (anyone who reaches the "
                             "port may use it); without this flag such a gateway refuses to start")
    parser.add_argument("--allowed-origin", action="append", default=None, dest="allowed_origin",
                        help="origin allowed to open /ws, e.g. https://chat.example.com (repeatable; "
                             "'*' allows any); none given: only the gateway's own page")
    parser.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes,
                        help="largest client frame accepted")
    parser.add_argument("--max-inflight", type=int, default=d.max_inflight,
                        help="requests streaming at once per connection")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                        help="longest prompt_token_ids accepted (0: the longest context a live worker "
                             "announces, no check while none does)")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="open WebSockets; more are refused with HTTP 503")
    parser.add_argument("--max-queued-jobs", type=int, default=d.max_queued_jobs,
                        help="OpenAI API requests get 429 + Retry-After while the request streams hold this "
                             "many jobs (waiting or running; 0: no bound)")
    parser.add_argument("--max-file-bytes", type=int, default=d.max_file_bytes,
                        help="largest file uploaded to /v1/files for the Batch API (kept in Redis; larger: 413)")
    parser.add_argument("--batch-seat-share", type=float, default=d.batch_seat_share,
                        help="share (0-1] of the live workers' seats the Batch API's lines may keep busy; the "
                             "rest stay free for interactive requests")
    parser.add_argument("--send-queue-bytes", type=int, default=d.send_queue_bytes,
                        help="per-connection bound on unsent frames; a slower reader is closed (code 4008)")
    parser.add_argument("--cancel-grace", type=float, default=d.cancel_grace_s,
                        help="seconds a closed socket's requests wait for a resume before being "
                             "cancelled (0: at once)")
    parser.add_argument("--request-ttl", type=float, default=d.request_ttl_s,
                        help="seconds the gateway's id claims and cancel markers live in Redis")
    parser.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                        help="seconds a connection has to send a request's headers (slow clients are cut off)")
    parser.add_argument("--web-root", type=Path, default=d.web_root, help="directory of the chat page")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _read_keys(path: Path | None) -> KeysFile:
    return KeysFile(()) if path is None else read_keys_file(path)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    from_file = _read_keys(args.api_keys_file)
    # --api-key keys have no tenant (as one-per-line files' keys): their jobs are untagged.
    keys = list(dict.fromkeys([*(k for k in (args.api_key or []) if k), *from_file.keys]))
    return GatewayConfig(host=args.host, port=args.port, redis_url=args.redis, prefix=args.prefix,
                         cluster=getattr(args, "cluster", False), request_shards=args.request_shards,
                         priority_lanes=args.priority_lanes, routing=args.routing,
                         redis_max_connections=args.redis_max_connections,
                         redis_pool_timeout_s=args.redis_pool_timeout,
                         api_keys=tuple(keys), tenants=from_file.tenants, key_tenants=from_file.key_tenants,
                         insecure_no_auth=args.insecure_no_auth,
                         allowed_origins=tuple(args.allowed_origin or ()),
                         max_frame_bytes=args.max_frame_bytes, max_inflight=args.max_inflight,
                         max_prompt_tokens=args.max_prompt_tokens, max_connections=args.max_connections,
                         max_queued_jobs=args.max_queued_jobs, max_file_bytes=args.max_file_bytes,
                         batch_seat_share=args.batch_seat_share,
                         send_queue_bytes=args.send_queue_bytes, cancel_grace_s=args.cancel_grace,
                         request_ttl_s=args.request_ttl, header_timeout_s=args.header_timeout,
                         web_root=args.web_root)


def run(args: argparse.Namespace) -> int:
    args.cluster = check_redis(args.redis)
    config = config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn logs its start, and every refused WebSocket handshake, at INFO.
    logging.getLogger("uvicorn").setLevel(max(logging.WARNING, logging.getLogger().level))

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
