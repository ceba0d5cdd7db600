"""The Redis streaming worker: jobs from a consumer group in, per-request events out (docs/protocol.md).

Task layout (anyio, one task group each, nothing outlives `Worker.run`):
  services: event writer, heartbeat (stats + keeping our pending entries fresh), cancel listener,
            prompt progress of long prompts (progress.py), engine step records (steps.py), with
            --metrics-port the queue's metrics (queue_metrics.py; metrics.py serves /metrics)
  reading:  XREADGROUP reader (intake) and XAUTOCLAIM reclaimer, both stopped first on shutdown
  jobs:     one task per request (a `JobRunner.run`), each owning its engine stream; cancelled (not
            answered) when the shutdown grace period runs out, so another worker resumes them
The engine steps in its own thread (AsyncEngine); job tasks only hand events to the writer, so
Redis I/O and generation never wait on each other.

`Worker` owns the Redis connection and the one `WorkerState`, builds each part with the state and
the collaborators it needs, and wires them into the task layout above.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.exceptions import ResponseError

from clients.backoff import TRANSIENT, retry
from workers import tracing
from workers.redis_options import async_client
from workers.worker.accounting import Accounting
from workers.worker.affinity import Affinity
from workers.worker.answers import Answers
from workers.worker.attempts import Attempts
from workers.worker.cancel import CancelListener
from workers.worker.config import WorkerConfig
from workers.worker.engine import Engine
from workers.worker.event_writer import EventWriter
from workers.worker.handoff import Handoff
from workers.worker.heartbeat import Heartbeat
from workers.worker.intake import Intake
from workers.worker.job import JobRunner
from workers.worker.metrics import WorkerMetrics
from workers.worker.progress import ProgressReporter
from workers.worker.queue_metrics import QUEUE_POLL_S, QueueMonitor
from workers.worker.reclaim import Reclaimer
from workers.worker.state import Delivery, WorkerState
from workers.worker.steps import StepMonitor
from workers.worker.streams import StreamSet

log = logging.getLogger("streamer.worker")

# KEYS[1] = a request stream; ARGV = group, consumer. Deletes the consumer if it holds no entry.
_LEAVE_GROUP = """
local held = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #held == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
  return 1
end
return 0
"""


class Worker:
    """`Worker(engine, config)`; `run` serves until `request_stop` (or the engine dies)."""

    def __init__(self, engine: Engine, config: WorkerConfig) -> None:
        self.engine, self.cfg, self.names = engine, config, config.names
        self.redis = async_client(config.redis_url, config.redis_max_connections, config.redis_pool_timeout_s,
                                  cluster=config.names.cluster, socket_connect_timeout=2)
        self.state = WorkerState(engine.admission_capacity, seats=lambda: int(engine.stats().get("max_num_seqs", 0)))
        # Counted whether or not --metrics-port serves them (a few microseconds per job and step).
        self.metrics = m = WorkerMetrics(engine, config.served_model_name or config.model_name, config.consumer)
        self.writer = EventWriter(self.redis, self.names, int(config.events_ttl_s * 1000),
                                  on_fenced=self.state.fenced, on_round_trip=m.event_write)
        self.answers = Answers(self.redis, config, self.state, self.writer, on_dead_letter=m.dead_lettered)
        # Prefixes, sessions and tenants' accounts, advertised for routing and fair sharing; kept three
        # heartbeats, like the stats hash.
        self.accounting = Accounting(self.redis, self.names, config.consumer, int(config.heartbeat_s * 3000),
                                     capacity=self._kv_tokens, held=self._shared_jobs)
        self.runner = JobRunner(engine, config, self.state, self.answers, Attempts(self.redis, self.names), m,
                                self.accounting)
        self.streams = StreamSet(self.redis, self.names, config.consumer)
        self.affinity = Affinity(self.redis, self.names, config.consumer, on_forward=self._forwarded)
        self.intake = Intake(self.redis, config, self.state, self.runner, self.streams, self.affinity)
        self.reclaimer = Reclaimer(self.redis, config, self.state, self.intake, on_reclaim=m.reclaimed)
        self.queue = QueueMonitor(config, m.registry, on_reconnect=m.reconnected,
                                  every_s=min(QUEUE_POLL_S, config.heartbeat_s))
        self.cancels = CancelListener(self.redis, self.names, engine, self.state, on_handoff=self.reclaimer.wake)
        self.handoff = Handoff(self.redis, self.names, self.names.group, config.consumer, self.state)
        self._leave_group = self.redis.register_script(_LEAVE_GROUP)
        self.heartbeat = Heartbeat(self.redis, config, engine, self.state, self.writer, self.cancels)
        self.progress = ProgressReporter(self.redis, self.names, engine, self.state, config.consumer,
                                         config.progress_every_s)
        # Sinks of the engine's step records; slow steps are traced.
        self.steps = StepMonitor(self.redis, self.names, engine, config.consumer, config.traces,
                                 sinks=[m.observe_steps], event_writes=self.writer.take_slowest_round_trip)

    @property
    def ready(self) -> anyio.Event:
        """Set once the worker reads jobs."""
        return self.state.ready

    @property
    def stopping(self) -> bool:
        return self.state.stopping

    def request_stop(self) -> None:
        """Stop reading new jobs; `run` finishes in-flight ones (within grace_s) and returns."""
        self.state.request_stop()

    def stats(self) -> dict[str, Any]:
        """What the heartbeat publishes in Redis."""
        return self.heartbeat.stats()

    async def run(self) -> None:
        cfg = self.cfg
        stats = self.engine.stats()
        log.info("worker %s: model %s on %s in %s, group %s on %s", cfg.consumer, cfg.model_name,
                 stats.get("device", "?"), stats.get("dtype", "?"), self.names.group, self.names.requests)
        if tracing.tracer("streamer-worker") is not None:
            log.info("worker %s: OpenTelemetry traces on (OTLP/HTTP)", cfg.consumer)
        await self.intake.ensure_group()
        # Its own stream registered before its first heartbeat makes it a routing target: a job
        # routed to it must be found by the others' reclaimers even if it dies at once.
        await retry("register", log, self.accounting.flush)
        try:
            if cfg.metrics_port:
                self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
                log.info("worker %s: metrics on http://%s:%d/metrics", cfg.consumer, cfg.metrics_host,
                         cfg.metrics_port)
            async with anyio.create_task_group() as services:
                services.start_soon(self.writer.run)
                services.start_soon(self.heartbeat.loop)
                services.start_soon(self.cancels.listen)
                services.start_soon(self.progress.loop)
                services.start_soon(self.steps.loop)
                services.start_soon(self.accounting.loop)
                if cfg.metrics_port:
                    services.start_soon(self.queue.loop)
                async with anyio.create_task_group() as jobs:
                    await self._read_until_stopped(jobs)
                    await self._finish_jobs(jobs)
                self.writer.close()
                with anyio.move_on_after(max(5.0, cfg.grace_s / 2)):
                    await self.writer.wait_idle()
                # Only now, with their events written, do unfinished jobs go to the other workers.
                await self.handoff.hand_back()
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await self._leave()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.metrics.close)
                await anyio.to_thread.run_sync(tracing.flush)
                await self.queue.aclose()
            await self.redis.aclose()
        if self.state.engine_error is not None:
            raise RuntimeError(f"worker stopped: the engine failed ({self.state.engine_error})")

    async def _read_until_stopped(self, jobs: TaskGroup) -> None:
        async with anyio.create_task_group() as reading:
            reading.start_soon(self.intake.read_loop, jobs)
            reading.start_soon(self.reclaimer.claim_loop, jobs)
            self.state.ready.set()
            await self.state.wait_stop()
            reading.cancel_scope.cancel()

    async def _finish_jobs(self, jobs: TaskGroup) -> None:
        """In-flight jobs get the grace period; what is left after it goes to other workers."""
        cfg, state = self.cfg, self.state
        log.info("worker %s: stopping, %d job(s) in flight (grace %.1fs)", cfg.consumer, state.held,
                 cfg.grace_s)
        with anyio.move_on_after(cfg.grace_s):
            await state.wait_idle()
        if state.held:
            log.warning("worker %s: grace period over, leaving %s to other workers", cfg.consumer,
                        sorted(state.running))
        jobs.cancel_scope.cancel()

    def _forwarded(self, d: Delivery) -> None:
        """A job taken here went to its session's worker: not this worker's charge, nor its job."""
        self.accounting.refund(d.charged_to, d.charged)
        self.metrics.forwarded()

    def _shared_jobs(self) -> int:
        """Jobs held from the shared lanes: routers count the routed ones from its own stream."""
        own = self.names.worker_requests(self.cfg.consumer)
        return sum(1 for stream, _ in self.state.pending_entries if stream != own)

    def _kv_tokens(self) -> int:
        """Tokens the engine's KV cache holds (what the prefix advertisement is bounded by)."""
        s = self.engine.stats()
        return int(s.get("kv_blocks_total", 0)) * int(s.get("block_size", 0))

    async def _leave(self) -> None:
        try:
            await self.redis.delete(self.names.worker(self.cfg.consumer))
            await self.accounting.leave()
            # Deleting a consumer drops its pending entries: only leave when Redis says it holds none
            # (an entry delivered just as reading stopped is reclaimed by another worker instead),
            # checked and done in one script so nothing is handed to us in between.
            for stream in self.streams.names_read:
                await self._leave_group(keys=[stream], args=[self.names.group, self.cfg.consumer])
            # Gone from the live set: jobs routed to it and still unread are adopted now, not later.
            await self.redis.publish(self.names.handoff, "left")
        except (*TRANSIENT, ResponseError) as e:
            log.warning("worker %s: could not deregister (%s)", self.cfg.consumer, e)
