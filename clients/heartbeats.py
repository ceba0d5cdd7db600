"""Which workers are alive: the heartbeat sorted set `PREFIX:heartbeats` (docs/protocol.md).

Each worker, on every heartbeat, adds itself to the set (member = consumer name, score = the Redis
server's time of the beat in ms, so no two machines' clocks are compared) and prunes members whose
last beat is older than `STALE_MS`; it removes itself when it stops. Readers (the gateway's
/healthz, `streamer up` waiting for its worker, a client checking that someone will serve its job,
benchmarks) ask for the members that beat within
`STALE_MS`: one O(log N + M) command, however many other keys the database holds. Nothing here
scans the keyspace. The per-worker hash `PREFIX:worker:{name}` keeps the details (stats) and still
expires 3 heartbeats after the last one, so a reader that also wants the details treats a member
without its hash as dead.
"""

from __future__ import annotations

from typing import Any

from clients.protocol import Names

# A worker beats every `heartbeat_s` seconds, at most 5 (workers/worker/config.py); three missed
# beats at the longest period mean it is dead.
STALE_MS = 15_000
# Most workers a reader lists (the most recent beats first); the set itself holds every live one.
MAX_LISTED = 1000

# ARGV[1] = STALE_MS, ARGV[2] = most members returned. Newest beat first.
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
"""


def live_script(client: Any) -> Any:
    """The reader's script, registered on a sync or asyncio redis-py client (loaded on first use).
    Call it as `script(keys=[names.heartbeats], args=[STALE_MS, limit])`; see `live_args`."""
    return client.register_script(_LIVE)


def live_args(names: Names, limit: int = MAX_LISTED) -> dict[str, list[Any]]:
    return {"keys": [names.heartbeats], "args": [STALE_MS, limit]}


def as_names(reply: list[Any]) -> list[str]:
    return [m.decode() if isinstance(m, bytes) else str(m) for m in reply]


def live_workers(client: Any, names: Names, limit: int = MAX_LISTED) -> list[str]:
    """Consumer names of the workers that beat within STALE_MS, newest first (sync client)."""
    return as_names(live_script(client)(**live_args(names, limit)))


async def live_worker_stats(redis: Any, names: Names, live: Any) -> list[dict[str, str]]:
    """Live workers with their stats hash (asyncio client; `live` = live_script(redis)), by name: two
    round trips whatever else Redis holds. A member counts when it beat within STALE_MS and its stats
    hash (which expires 3 beats after the last one) is still there."""
    members = as_names(await live(**live_args(names)))
    if not members:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for name in members:
            pipe.hgetall(names.worker(name))
        replies = await pipe.execute(raise_on_error=False)
    found = []
    for name, fields in zip(members, replies, strict=True):
        if isinstance(fields, dict) and fields:  # not an error reply (a key of the wrong type)
            found.append({"name": name, **{k.decode(errors="replace"): v.decode(errors="replace")
                                           for k, v in fields.items()}})
    return sorted(found, key=lambda w: w["name"])
