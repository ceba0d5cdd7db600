"""Faults caused on a real redis-server, for the tests of what talks to it (no mocked Redis): its writes
held (CLIENT PAUSE WRITE: a round trip stays at Redis while the test acts), a client's connections
dropped (CLIENT KILL: its round trip fails as on a restart). Reads and CLIENT/CONFIG commands go on
during a WRITE pause."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis


@asynccontextmanager
async def writes_held(r: aioredis.Redis) -> AsyncIterator[None]:
    """Redis holds every write until the block ends (and by itself for at most 10 s, should a test fail
    inside and leave the session's server paused)."""
    await r.client_pause(10_000, all=False)
    try:
        yield
    finally:
        await r.client_unpause()


async def drop_connections(r: aioredis.Redis, name: str) -> None:
    """CLIENT KILL every connection named `name` (CLIENT SETNAME): their round trips fail as on a
    dropped connection."""
    ids = [c["id"] for c in await r.client_list() if c["name"] == name]
    assert ids, f"no connection named {name!r}"
    for client_id in ids:
        await r.client_kill_filter(_id=client_id)
