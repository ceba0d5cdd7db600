"""Cancels for the Redis worker: the pub/sub listener, and what a cancel does to a job here."""

from __future__ import annotations

import logging
import time

from workers.backoff import TRANSIENT, Backoff
from workers.worker_state import WorkerState, as_str

log = logging.getLogger("streamer.worker")


class CancelHandling(WorkerState):
    """Cancels arrive by pub/sub here, and from the cancel markers the heartbeat finds."""

    async def _cancel_loop(self) -> None:
        backoff = Backoff("cancel listener", log)
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.names.cancel)
                    backoff.reset()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.cancel(as_str(message["data"]))
            except TRANSIENT as e:
                await backoff.sleep(e)

    def cancel(self, request_id: str) -> None:
        if request_id in self._running:
            log.info("request %s: cancelled", request_id)
            self.engine.abort(request_id)
            return
        # Maybe read but not yet running here: remember it for a while (bounded).
        self._cancelled[request_id] = time.monotonic()
        while len(self._cancelled) > 10_000:
            self._cancelled.popitem(last=False)
