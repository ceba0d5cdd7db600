"""Every request stream in use: the lanes and tenants' queues submitters registered, the sharded
streams, and the workers' own streams (docs/scheduling.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clients.names import DEFAULT_LANE_RANK, Names


@dataclass(frozen=True)
class StreamInfo:
    stream: str
    rank: int  # lane rank: lower is read first
    tenant: str  # "" outside a tenant's queue


def tenant_of(names: Names, stream: str, rank: int) -> str:
    lane = names.lane(rank)
    prefix = f"{lane}:t:"
    return stream[len(prefix):] if stream.startswith(prefix) else ""


def parse_registry(names: Names, reply: list[Any]) -> list[StreamInfo]:
    """ZRANGE ... WITHSCORES of the registry -> streams in reading order (the default lane and the
    sharded streams are always there, registered or not)."""
    found = {_text(member): int(float(score)) for member, score in reply}
    for stream in names.request_streams:
        found.setdefault(stream, DEFAULT_LANE_RANK)
    return sorted((StreamInfo(s, r, tenant_of(names, s, r)) for s, r in found.items()),
                  key=lambda i: (i.rank, i.tenant, i.stream))


async def registered_streams(redis: Any, names: Names) -> tuple[list[StreamInfo], int]:
    """The streams in reading order, and how many the registry itself holds."""
    reply = await redis.zrange(names.streams, 0, -1, withscores=True)
    return parse_registry(names, reply), len(reply)


async def worker_stream_owners(redis: Any, names: Names) -> dict[str, int]:
    """Workers that own a stream -> their last beat (ms)."""
    reply = await redis.zrange(names.worker_streams, 0, -1, withscores=True)
    return {_text(member): int(float(score)) for member, score in reply}


async def all_streams(redis: Any, names: Names) -> list[str]:
    """Every request stream: registered ones, then the workers' own."""
    shared = [i.stream for i in (await registered_streams(redis, names))[0]]
    return shared + [names.worker_requests(w) for w in await worker_stream_owners(redis, names)]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
