"""Queue metrics (docs/observability.md#queue-metrics): per request stream, the jobs it holds
(`backlog`: waiting or in flight; answered jobs leave the stream), the jobs no worker has read yet
(`lag`) and the jobs delivered to a worker and not yet answered (`pending`).

These describe a stream, not a worker, yet every worker can read them: summed over workers they would
count each job once per worker. So only one worker exports them: the live worker whose consumer name
sorts first in the heartbeat set (clients/heartbeats.py). Every worker reads the set on each poll, so
each knows whether that is itself, with no election to run and nothing more to keep in Redis. When
that worker leaves, the next one takes over on its next poll; when it dies without leaving, once its
heartbeat goes stale (clients.heartbeats.STALE_MS, no queue metrics until then). A worker joining with
a name that sorts first exports from its first poll, while the old exporter stops on its next: for
at most one poll period both do. `streamer_queue_exporter{worker}` says which worker exports (1).

The series carry no `worker` label: a change of exporter leaves the series as they were.

The monitor has a Redis connection of its own, used every poll (every worker polls the heartbeat
set), so it also tells when the worker's connection to Redis was lost
(`streamer_worker_redis_reconnects_total`, once per poll that had to reconnect): a poll that went
through after one failed, or one whose connection had to be made again, however short the outage.
redis-py remakes a connection the server closed when it is next taken from the pool, so a poll after
a quick Redis restart does not fail: the connection's own connect callback tells. The worker's other
connections, in a pool, are remade by whichever loop uses them next, without a trace.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from redis.exceptions import ResponseError

from clients.backoff import TRANSIENT
from clients.heartbeats import as_names, live_args, live_script
from clients.streams import all_streams
from workers.redis_options import async_client
from workers.worker.config import WorkerConfig
from workers.worker.state import as_str

log = logging.getLogger("streamer.worker")

QUEUE_POLL_S = 1.0  # how often the queue is read (at most; 2 commands per request stream, by one worker)

_GAUGES = (
    ("streamer_queue_backlog", "Jobs in the request stream: not yet read, or read and not yet answered "
                               "(answered jobs are deleted from it)."),
    ("streamer_queue_lag", "Jobs in the request stream that no worker has read yet."),
    ("streamer_queue_pending", "Jobs delivered to a worker and not yet answered (acked), including those "
                               "held by a dead worker until another reclaims them."),
)


class QueueMonitor:
    """Every `every_s`, reads the heartbeat set, and the request streams while this worker is the
    exporter; a collector of `registry` (what it last read: nothing while it is not the exporter or
    Redis failed). `on_reconnect()`: a poll went through after one failed for want of Redis, or had
    to make its connection again."""

    def __init__(self, config: WorkerConfig, registry: CollectorRegistry,
                 on_reconnect: Callable[[], None] = lambda: None, every_s: float = QUEUE_POLL_S) -> None:
        self.names, self.consumer, self.every_s = config.names, config.consumer, every_s
        self.on_reconnect = on_reconnect
        self._made: weakref.WeakSet[Any] = weakref.WeakSet()  # connections that have connected once
        self._remade = False  # during this poll, one of them connected again
        # A cluster client sets its nodes' connect callbacks itself: there only a failed poll counts.
        hook = {} if config.names.cluster else {"redis_connect_func": self._connected}
        self.redis = async_client(config.redis_url, 1, config.redis_pool_timeout_s, cluster=config.names.cluster,
                                  socket_connect_timeout=2, **hook)
        self._live = live_script(self.redis)
        self.exporting = False
        self.queues: dict[str, tuple[int, int, int]] = {}  # stream -> (backlog, lag, pending)
        self.service: dict[str, float] = {}  # tenant -> service clock (tokens / share), streams.py
        registry.register(self)

    async def loop(self) -> None:
        failed = False
        while True:
            try:
                self._remade = False
                await self.poll()
                if failed or self._remade:
                    self.on_reconnect()
                failed = False
            except TRANSIENT as e:  # the other loops log it; here the numbers just go away meanwhile
                log.debug("queue metrics: Redis unavailable (%r)", e)
                failed, self.queues = True, {}
            except ResponseError as e:  # e.g. the script cache or the group lost with Redis's data
                log.debug("queue metrics: Redis refused (%s)", e)
                self.queues = {}
            await anyio.sleep(self.every_s)

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def _connected(self, connection: Any) -> None:
        await connection.on_connect()  # what redis-py runs without a callback (AUTH, SELECT, ...)
        self._remade = self._remade or connection in self._made
        self._made.add(connection)

    async def poll(self) -> None:
        live = as_names(await self._live(**live_args(self.names)))
        self.exporting = bool(live) and min(live) == self.consumer
        if not self.exporting:
            self.queues = {}
            return
        # Every lane, tenant's queue and worker's own stream (clients/streams.py).
        streams = await all_streams(self.redis, self.names)
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
            pipe.hgetall(self.names.service)
            replies = await pipe.execute(raise_on_error=False)
        service = replies.pop()
        self.service = {as_str(k): float(v) for k, v in service.items()} if isinstance(service, dict) else {}
        queues = {}
        for i, stream in enumerate(streams):
            length, groups = replies[2 * i: 2 * i + 2]
            if isinstance(length, Exception) or isinstance(groups, Exception):
                continue  # e.g. the stream is gone with Redis's data: the reader recreates it
            queues[stream] = (int(length), *self._lag_and_pending(int(length), groups))
        self.queues = queues

    def _lag_and_pending(self, length: int, groups: Any) -> tuple[int, int]:
        for group in groups or []:
            info = {as_str(k): v for k, v in group.items()}
            if as_str(info.get("name", b"")) != self.names.group:
                continue
            pending = int(info.get("pending") or 0)
            lag = info.get("lag")
            # Redis cannot say (None) after an entry no one had read was deleted (a client withdrew its
            # job); answered jobs leave the stream, so what is neither pending nor answered is unread.
            return (max(0, length - pending) if lag is None else int(lag)), pending
        return length, 0  # no worker ever created the group: everything waits

    def collect(self) -> Iterator[Metric]:
        exporter = GaugeMetricFamily("streamer_queue_exporter", "1 on the one worker that exports the "
                                     "streamer_queue_* gauges (the first live worker by name), 0 on the "
                                     "others.", labels=["worker"])
        exporter.add_metric([self.consumer], 1.0 if self.exporting else 0.0)
        yield exporter
        queues = self.queues
        if not queues:
            return
        for k, (name, help_text) in enumerate(_GAUGES):
            gauge = GaugeMetricFamily(name, help_text, labels=["stream"])
            for stream, values in queues.items():
                gauge.add_metric([stream], float(values[k]))
            yield gauge
        service = GaugeMetricFamily("streamer_tenant_service", "Each tenant's fair-share clock: tokens its "
                                    "jobs were given divided by its share ('~': jobs without a tenant); under "
                                    "saturation the clocks of backlogged tenants advance together.",
                                    labels=["tenant"])
        for tenant, value in self.service.items():
            if tenant != "~clock":
                service.add_metric([tenant], value)
        yield service
