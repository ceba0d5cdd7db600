"""Lua scripts queued in pipelines, the same way on a single Redis and on a Redis Cluster.

redis-py loads a pipeline's scripts by itself on a single Redis; a cluster pipeline refuses script
objects, so there the script goes in as a plain EVALSHA (routed by its keys, which share a slot) and
whoever sees NOSCRIPT in the replies (a fresh or restarted node) loads the scripts on every primary
(`load`) and runs the round trip again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import ClusterPipeline
from redis.commands.core import AsyncScript


async def queue(pipe: Any, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> None:
    """Queue one call of `script` in `pipe` (a pipeline of a single Redis or of a cluster)."""
    if isinstance(pipe, ClusterPipeline):
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    else:
        await script(keys=keys, args=args, client=pipe)


async def load(redis: Any, *scripts: AsyncScript) -> None:
    """Load scripts on the server (on a cluster: on every primary)."""
    for script in scripts:
        await redis.script_load(script.script)
