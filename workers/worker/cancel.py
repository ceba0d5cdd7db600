"""Cancels for the Redis worker: the pub/sub listener, and what a cancel does to a job here. The same
subscription hears draining workers hand jobs back (handoff.py), and wakes the reclaimer."""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.asyncio import Redis

from clients.backoff import TRANSIENT, Backoff
from clients.protocol import Names
from workers.worker.engine import Engine
from workers.worker.state import WorkerState, as_str

log = logging.getLogger("streamer.worker")


class CancelListener:
    """Cancels arrive by pub/sub here, and from the cancel markers the heartbeat finds."""

    def __init__(self, redis: Redis, names: Names, engine: Engine, state: WorkerState,
                 on_handoff: Callable[[], None] = lambda: None) -> None:
        self.redis, self.names, self.engine, self.state = redis, names, engine, state
        self.on_handoff = on_handoff

    async def listen(self) -> None:
        backoff = Backoff("cancel listener", log)
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.names.cancel, self.names.handoff)
                    backoff.reset()
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        if as_str(message["channel"]) == self.names.handoff:
                            self.on_handoff()
                        else:
                            self.cancel(as_str(message["data"]))
            except TRANSIENT as e:
                await backoff.sleep(e)

    def cancel(self, request_id: str) -> None:
        if request_id in self.state.running:
            log.info("request %s: cancelled", request_id)
            self.engine.abort(request_id)
        else:  # maybe read but not yet running here
            self.state.remember_cancel(request_id)
