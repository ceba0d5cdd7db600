"""How far each job's prompt is, in Redis for the clients that show it (`progress:{id}`).

A long prompt is computed in chunks over many steps (tens of seconds for thousands of tokens on a
CPU) before its first token: without this, a waiting user sees nothing happen. Every half second
(`progress_every_s`) the worker writes, for each of its jobs still computing its prompt, one small
JSON value with a short TTL; a job past its prompt simply stops being written and its key expires. Best effort: a
write that fails is only a display that lags.
"""

from __future__ import annotations

import json
import logging

import anyio
from redis.asyncio import Redis

from clients.backoff import TRANSIENT
from clients.names import Names
from workers.worker.engine import Engine
from workers.worker.state import WorkerState

log = logging.getLogger("streamer.worker")

PROGRESS_TTL_MS = 3_000  # a few writes: a worker that dies leaves no stale "processing" behind


class ProgressReporter:
    def __init__(self, redis: Redis, names: Names, engine: Engine, state: WorkerState, consumer: str,
                 every_s: float) -> None:
        self.redis, self.names, self.engine, self.state, self.consumer = redis, names, engine, state, consumer
        self.every_s = every_s

    async def loop(self) -> None:
        while True:
            await anyio.sleep(self.every_s)
            try:
                await self.report()
            except TRANSIENT as e:
                log.debug("prompt progress not written: %r", e)

    async def report(self) -> None:
        ours = {rid: p for rid, p in self.engine.prompt_progress().items() if rid in self.state.running}
        if not ours:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid, p in ours.items():
                value = {"state": "prefill" if p.scheduled else "waiting", "computed": p.computed_tokens,
                         "total": p.prompt_tokens, "worker": self.consumer}
                pipe.set(self.names.progress(rid), json.dumps(value), px=PROGRESS_TTL_MS)
            await pipe.execute()
