"""Redis options shared by the commands that speak the protocol (worker, gateway, generate), the
asyncio client every long-running process uses (`async_client`: a bounded pool that queues), and
the one start-up check that Redis is there (worker, generate, up)."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.cluster

from clients.errors import redact_url
from clients.protocol import Names
from workers.arg_types import redis_url
from workers.errors import RedisUnavailable, redis_hint

# Connections one process opens to Redis at most (its pub/sub connection included). Redis serves
# commands one at a time: past a few dozen connections more only cost memory on both sides, while
# a burst of requests queues for a free connection instead of failing (`async_client`).
DEFAULT_MAX_CONNECTIONS = 64
# How long a command waits for a free connection before it fails (then: Redis is unavailable).
DEFAULT_POOL_TIMEOUT_S = 20.0


def add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", type=redis_url, default="redis://127.0.0.1:6379/0", help="Redis URL")
    parser.add_argument("--prefix", default="llm", help="prefix of every Redis name")
    parser.add_argument("--requests-stream", default="", help="requests stream (default PREFIX:requests)")
    parser.add_argument("--cancel-channel", default="", help="cancel channel (default PREFIX:cancel)")
    parser.add_argument("--request-shards", type=int, default=1,
                        help="request streams jobs are spread over (the same for every client and worker)")


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The bound of a long-running process's Redis connections (worker, gateway)."""
    parser.add_argument("--redis-max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="most connections to Redis; commands beyond them wait for a free one")
    parser.add_argument("--redis-pool-timeout", type=float, default=DEFAULT_POOL_TIMEOUT_S,
                        help="seconds a command waits for a free Redis connection before failing")


def names_from_args(args: argparse.Namespace) -> Names:
    """`args.cluster` (set from check_redis) makes them a Redis Cluster's names (hash tags)."""
    return Names(prefix=args.prefix, requests=args.requests_stream, cancel=args.cancel_channel,
                 group=getattr(args, "group", ""), dead=getattr(args, "dead_stream", ""),
                 cluster=getattr(args, "cluster", False), shards=getattr(args, "request_shards", 1))


def pool_url(url: str, max_connections: int = DEFAULT_MAX_CONNECTIONS,
             timeout_s: float = DEFAULT_POOL_TIMEOUT_S) -> str:
    """`url` with the pool's bound in its query (`max_connections`, `timeout`: redis-py reads both),
    unless the URL already names them: the URL the operator wrote wins."""
    given = {k for k, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
    missing = [(k, v) for k, v in (("max_connections", max_connections), ("timeout", timeout_s))
               if k not in given]
    if not missing:
        return url
    return url + ("&" if "?" in url else "?") + urlencode(missing)


def async_client(url: str, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 timeout_s: float = DEFAULT_POOL_TIMEOUT_S, cluster: bool = False, **kwargs: Any) -> Any:
    """An asyncio client whose pool holds at most `max_connections` connections. A command that finds
    them all busy waits up to `timeout_s` for one (then redis.ConnectionError, like a Redis that is
    down) instead of failing at once as redis-py's default pool does when it is full: a burst of
    requests is served a little later, not refused. `max_connections` / `timeout` in the URL's query
    win over the arguments. `kwargs` are connection options (socket timeouts, health checks)."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    if cluster:
        # A cluster client holds one bounded pool per node; one that is full raises MaxConnectionsError
        # (a ConnectionError: retried with backoff like a Redis that is briefly unavailable).
        parts = urlsplit(url)  # the pool's query options are not a cluster client's
        query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "timeout"]
        url = parts._replace(query=urlencode(query)).geturl()
        return aioredis.RedisCluster.from_url(url, max_connections=max_connections, **kwargs)
    # redis-py lets the URL's query override these keyword arguments.
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s,
                                                    **kwargs)
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


def sync_client(url: str, cluster: bool = False) -> Any:
    """A blocking client of a single Redis, or of a Redis Cluster."""
    kind = redis.cluster.RedisCluster if cluster else redis.Redis
    return kind.from_url(url, socket_connect_timeout=3, socket_timeout=5)


def check_redis(url: str) -> bool:
    """Fail fast with a one-line message when Redis is not there at start (later drops are retried).
    Returns whether it is a node of a Redis Cluster (then names carry hash tags: `Names.cluster`)."""
    client = sync_client(url)
    try:
        client.ping()
        info = client.info("server")
        if info.get("redis_mode") != "cluster":
            return False
        if int(str(info.get("redis_version", "0")).split(".")[0]) < 7:
            raise RedisUnavailable(f"Redis at {redact_url(url)} is a cluster of Redis "
                                   f"{info.get('redis_version')}: streamer needs Redis 7 or newer on a cluster "
                                   "(sharded pub/sub)")
        return True
    except redis.exceptions.AuthenticationError as exc:
        raise RedisUnavailable(f"Redis at {redact_url(url)} refused the credentials: put the "
                               "password in the URL (redis://:PASSWORD@HOST:PORT/0)") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise RedisUnavailable(redis_hint(url)) from exc
    finally:
        client.close()
