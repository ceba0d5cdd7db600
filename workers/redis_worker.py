"""The Redis streaming worker: jobs from a consumer group in, per-request events out (docs/protocol.md).

Task layout (anyio, one task group each, nothing outlives `Worker.run`):
  services: event writer, heartbeat (stats + keeping our pending entries fresh), cancel listener
  intake:   XREADGROUP reader and XAUTOCLAIM reclaimer, both stopped first on shutdown
  jobs:     one task per request, each owning its engine stream; cancelled (not answered) when the
            shutdown grace period runs out, so another worker resumes them
The engine steps in its own thread (AsyncEngine); job tasks only hand events to the writer, so
Redis I/O and generation never wait on each other.

The parts, one module each, are mixins on WorkerState (workers/worker_state.py: shared counters):
  worker_intake.py (read, admit), worker_reclaim.py (take over dead workers' entries),
  worker_job.py (one job), worker_answers.py (events, dead letters, acks),
  worker_cancel.py, worker_heartbeat.py; this module wires them into the task layout above.
"""

from __future__ import annotations

import logging

import anyio

from workers.backoff import TRANSIENT
from workers.worker_config import WorkerConfig
from workers.worker_heartbeat import Heartbeat
from workers.worker_reclaim import Reclaimer

__all__ = ["Worker", "WorkerConfig"]

log = logging.getLogger("streamer.worker")


class Worker(Reclaimer, Heartbeat):
    """`Worker(engine, config)`; `run` serves until `request_stop` (or the engine dies)."""

    async def run(self) -> None:
        cfg = self.cfg
        log.info("worker %s: model %s, group %s on %s", cfg.consumer, cfg.model_name, self.names.group,
                 self.names.requests)
        await self._ensure_group()
        try:
            async with anyio.create_task_group() as services:
                services.start_soon(self.writer.run)
                services.start_soon(self._heartbeat_loop)
                services.start_soon(self._cancel_loop)
                async with anyio.create_task_group() as jobs:
                    self._jobs = jobs
                    async with anyio.create_task_group() as intake:
                        intake.start_soon(self._read_loop)
                        intake.start_soon(self._claim_loop)
                        self.ready.set()
                        await self._stop.wait()
                        intake.cancel_scope.cancel()
                    log.info("worker %s: stopping, %d job(s) in flight (grace %.1fs)", cfg.consumer,
                             len(self._running) + self._starting, cfg.grace_s)
                    with anyio.move_on_after(cfg.grace_s):
                        await self._jobs_idle.wait()
                    if self._running or self._starting:
                        log.warning("worker %s: grace period over, leaving %s to other workers",
                                    cfg.consumer, sorted(self._running))
                    jobs.cancel_scope.cancel()
                self.writer.close()
                with anyio.move_on_after(max(5.0, cfg.grace_s / 2)):
                    await self.writer.wait_idle()
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self._leave()
            await self.redis.aclose()
        if self.engine_error is not None:
            raise RuntimeError(f"worker stopped: the engine failed ({self.engine_error})")

    async def _leave(self) -> None:
        try:
            await self.redis.delete(self.names.worker(self.cfg.consumer))
            # Deleting a consumer drops its pending entries: only leave when Redis says it holds none
            # (an entry delivered just as reading stopped is reclaimed by another worker instead).
            held = await self.redis.xpending_range(self.names.requests, self.names.group, "-", "+", 1,
                                                   consumername=self.cfg.consumer)
            if not held:
                await self.redis.xgroup_delconsumer(self.names.requests, self.names.group, self.cfg.consumer)
        except TRANSIENT as e:
            log.warning("worker %s: could not deregister (%s)", self.cfg.consumer, e)
