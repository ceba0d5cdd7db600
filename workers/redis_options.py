"""Redis options shared by the commands that speak the protocol (worker, generate), and the one
start-up check that Redis is there (worker, generate, up)."""

from __future__ import annotations

import argparse

import redis

from clients.protocol import Names
from workers.errors import RedisUnavailable, redact_url, redis_hint


def add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL")
    parser.add_argument("--prefix", default="llm", help="prefix of every Redis name")
    parser.add_argument("--requests-stream", default="", help="requests stream (default PREFIX:requests)")
    parser.add_argument("--cancel-channel", default="", help="cancel channel (default PREFIX:cancel)")


def names_from_args(args: argparse.Namespace) -> Names:
    return Names(prefix=args.prefix, requests=args.requests_stream, cancel=args.cancel_channel,
                 group=getattr(args, "group", ""), dead=getattr(args, "dead_stream", ""))


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5)


def check_redis(url: str) -> None:
    """Fail fast with a one-line message when Redis is not there at start (later drops are retried)."""
    client = sync_client(url)
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as exc:
        raise RedisUnavailable(f"Redis at {redact_url(url)} refused the credentials: put the "
                               "password in the URL (redis://:PASSWORD@HOST:PORT/0)") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise RedisUnavailable(redis_hint(url)) from exc
    finally:
        client.close()
