"""`streamer top`: a live view of every worker from Redis, refreshed like `htop`.

Per worker: model, device, running / waiting sequences, jobs held, a KV-cache bar, tokens/s (from the
cumulative token counter of successive heartbeats) and the age of its last beat; per request stream:
its backlog (XLEN: jobs waiting or being served) and each consumer group's consumers, pending entries
and lag (XINFO GROUPS); the dead letters (XLEN); the newest slow-step traces (`llm:traces`).
Reading is top_data.py (one pipelined round trip per refresh), drawing top_view.py.
"""

from __future__ import annotations

import argparse
import os
import time

import redis.exceptions
from rich.console import Console
from rich.live import Live

from clients.errors import redact_url
from workers.arg_types import count, refresh_seconds
from workers.cli.top_data import Gatherer
from workers.cli.top_view import render
from workers.redis_options import add_redis_arguments, check_redis, names_from_args, sync_client

PIPED_WIDTH = 160  # columns of a frame printed to a file or pipe (no terminal to take the width from)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_arguments(parser)
    parser.add_argument("--dead-stream", default="", help="dead-letter stream (default PREFIX:dead)")
    parser.add_argument("--interval", type=refresh_seconds, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true",
                        help="print one frame and exit (what top does anyway when stdout is not a terminal)")
    parser.add_argument("--slow-steps", type=count, default=5, help="how many of the newest slow-step traces to show")


def run(args: argparse.Namespace) -> int:
    args.cluster = check_redis(args.redis)
    client = sync_client(args.redis, cluster=args.cluster)
    gather = Gatherer(client, names_from_args(args), redact_url(args.redis), args.slow_steps)
    console = Console()
    try:
        if args.once or not console.is_terminal:
            if not console.is_terminal and not os.environ.get("COLUMNS"):
                console.width = PIPED_WIDTH
            console.print(render(gather.snapshot()))
            return 0
        _live(console, gather, args.interval)
    except KeyboardInterrupt:  # Ctrl-C is how one leaves a live view: not a failure
        return 0
    finally:
        client.close()
    return 0


def _live(console: Console, gather: Gatherer, interval: float) -> None:
    """Redraw every `interval` s until Ctrl-C; a Redis that goes away keeps the last frame, marked."""
    frame = gather.snapshot()
    with Live(render(frame), console=console, auto_refresh=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        while True:
            time.sleep(interval)
            try:
                frame = gather.snapshot()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                frame = {**frame, "error": f"cannot reach Redis ({exc}): this frame is from before; "
                                           f"retrying every {interval:g}s (Ctrl-C to quit)"}
            live.update(render(frame), refresh=True)
