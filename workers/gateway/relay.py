"""The gateway's event relay: each request's events, in `seq` order, to whoever watches it.

One pub/sub connection serves every request of the process (SUBSCRIBE per `tokens:{id}` channel, while
someone watches it; on a cluster, one per shard master). Pub/sub is fast but lossy (a reader that
subscribed late, a dropped connection), so the events stream `events:{id}` is the source of truth: a
`Watch` delivers `seq` 0, 1, 2 ... exactly once, reading the stream to fill any gap (resume, a missed
message, an idle watch, a Redis reconnect). Event ids in the stream are `0-(seq+1)`
(clients.protocol.event_stream_id), so a fill starts at its seq.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from clients.backoff import TRANSIENT, Backoff
from clients.errors import ProtocolError
from clients.protocol import Names, decode_message, decode_payload, event_stream_id, split_fields
from workers.gateway.metrics import Metrics
from workers.gateway.watch import Watch

log = logging.getLogger("streamer.gateway")

_FILL_BATCH = 256
SUBSCRIBE_TIMEOUT_S = 5.0  # Redis confirms a SUBSCRIBE at once; this long without it means trouble
Spawn = Callable[[Any, str], None]  # Hub.spawn: a tracked background task, its failure logged


def resumed_channel(names: Names) -> str:
    """Where gateways tell each other about resumes (Hub.announce_resume), so a request resumed through
    another gateway is not cancelled by the one whose socket closed."""
    return f"{names.prefix}:gateway:resumed"


def _json_text(event: dict[str, Any], raw: bytes, encoding: str) -> str:
    """What a browser gets: the worker's JSON text as is (no re-encoding), or msgpack turned into JSON."""
    if encoding == "json":
        return raw.decode("utf-8")
    return json.dumps(event, ensure_ascii=False, separators=(",", ":"))


async def _close_later(pubsub: Any) -> None:
    await asyncio.sleep(2.0)  # the read loop waits at most 1 s on it
    try:
        await pubsub.aclose()
    except Exception as e:  # it was broken already
        log.info("closing a replaced pub/sub connection: %r", e)


class EventRelay:
    """Owns the pub/sub connections and the watches they feed (watch.Relay)."""

    def __init__(self, redis: Any, names: Names, metrics: Metrics, spawn: Spawn, *, idle_poll_s: float) -> None:
        self.redis, self.names, self.metrics, self.spawn, self.idle_poll_s = redis, names, metrics, spawn, idle_poll_s
        self.pubsub = redis.pubsub()
        # On a cluster the tokens channels are shard channels, served by the master of their slot: one
        # plain pub/sub connection per master (made when first needed), each read by its own loop.
        self._shard_pubsubs: dict[str, Any] = {}
        self.watches: dict[str, set[Watch]] = {}  # channel -> readers (the subscriptions we want)
        # channel -> set once the current connection confirmed it; cleared (not replaced: watches wait
        # on it) whenever a fresh connection subscribes again.
        self._subscribed: dict[str, asyncio.Event] = {}
        self._sub_lock = asyncio.Lock()  # SUBSCRIBE/UNSUBSCRIBE go out in decision order
        # Being subscribed to the resumes channel also keeps the pub/sub connection open while no
        # request is watched.
        self.resumed_channel = resumed_channel(names)
        self.on_resumed: Callable[[str], None] = lambda request_id: None
        # Only the read loop replaces the connection, one at a time: when every watch waiting for a
        # confirmation replaced it by itself, hundreds did so at once after a Redis restart under
        # load, each new connection was dropped before its confirmations were read, and the gateway
        # never recovered.
        self.generation = 0  # raised by every fresh pub/sub connection
        self._connected = False  # the current connection has sent its SUBSCRIBE and not failed since
        self._replace_generation = -1  # a watch asks for this generation's connection to be replaced
        # The current connection confirmed the resumes channel and no subscription timed out since:
        # /readyz is 503 otherwise (a gateway that cannot hear events must not get traffic).
        self.ready = False
        # Set by close(): the loops end on it too, so a cancel swallowed somewhere inside redis-py
        # (seen as a connect timeout, and retried) cannot keep one running after the gateway closed.
        self.closed = False

    async def start(self) -> asyncio.Future[Any]:
        """Subscribes to the resumes channel; returns the loops to run until the gateway closes."""
        await self._connect()
        return asyncio.gather(self._main_loop(), self._idle_loop())

    async def close(self) -> None:
        self.closed = True
        await self.pubsub.aclose()
        for pubsub in self._shard_pubsubs.values():
            await pubsub.aclose()
            await pubsub.connection_pool.aclose()

    # --- watching ----------------------------------------------------------------------------------

    async def watch(self, request_id: str, next_seq: int,
                    on_event: Callable[[dict[str, Any], str], None]) -> Watch:
        """Start relaying. Returns once the subscription is live, so nothing published after this returns
        is missed; what was published before is read with `fill` (a resume)."""
        w = Watch(self, request_id, self.names.tokens(request_id), next_seq, on_event)
        self.watches.setdefault(w.channel, set()).add(w)
        try:
            await self._sync(w.channel)
            confirmed = self._subscribed.get(w.channel)
            if confirmed is None:  # unwatched meanwhile; nothing to wait for
                return w
            generation = self.generation
            try:
                await asyncio.wait_for(confirmed.wait(), timeout=SUBSCRIBE_TIMEOUT_S)
            except TimeoutError:
                # Redis answers a SUBSCRIBE at once: a connection that stays silent is wedged (seen
                # after Redis restarts under load). The read loop replaces it, once however many
                # watches ask, and subscribes to every watched channel again.
                self._ask_replace(generation)
                try:
                    await asyncio.wait_for(confirmed.wait(), timeout=SUBSCRIBE_TIMEOUT_S)
                except TimeoutError:
                    raise RedisConnectionError("the gateway's pub/sub connection did not confirm a "
                                               "subscription; retry shortly") from None
        except BaseException:
            self.unwatch(w)
            raise
        return w

    def _ask_replace(self, generation: int) -> None:
        if generation == self.generation and self._replace_generation != generation:
            self._replace_generation = generation
            self.ready = False
            self.metrics.inc("redis_errors_total")
            log.warning("gateway pub/sub: a subscription was not confirmed in %ss; replacing the connection",
                        SUBSCRIBE_TIMEOUT_S)

    async def _connect(self) -> None:
        """A fresh pub/sub connection, subscribed in one SUBSCRIBE to the resumes channel and every
        watched channel; the old one is closed once nothing reads it. Raises what Redis raises."""
        async with self._sub_lock:
            old, self.pubsub = self.pubsub, self.redis.pubsub()
            self.spawn(_close_later(old), "close the replaced pub/sub connection")
            self.generation += 1
            self._connected = self.ready = False
            for channel in [c for c in self._subscribed if c not in self.watches]:
                del self._subscribed[channel]
            channels = [] if self.names.cluster else list(self.watches)  # shard channels: own connections
            for channel in channels:
                self._subscribed.setdefault(channel, asyncio.Event()).clear()
            await self.pubsub.subscribe(self.resumed_channel, *channels)
            self._connected = True

    def unwatch(self, w: Watch) -> None:
        if w.closed:
            return
        w.closed = True
        readers = self.watches.get(w.channel)
        if readers is not None:
            readers.discard(w)
            if not readers:
                del self.watches[w.channel]
                self.spawn(self._sync(w.channel), f"unsubscribe {w.channel}")

    async def _sync(self, channel: str) -> None:
        """Make Redis's subscription match `self.watches` for one channel. Decided under the lock, so
        an unsubscribe scheduled before a new watch can never land after that watch's subscribe."""
        async with self._sub_lock:
            want, have = channel in self.watches, channel in self._subscribed
            if want and not have:
                self._subscribed[channel] = asyncio.Event()
                if not self._connected and not self.names.cluster:
                    return  # the read loop's next connection subscribes to it with the others
                try:
                    if self.names.cluster:
                        await self._shard_subscribe(channel)
                    else:
                        await self.pubsub.subscribe(channel)
                except BaseException:
                    del self._subscribed[channel]
                    raise
            elif have and not want:
                del self._subscribed[channel]
                try:
                    if self.names.cluster:
                        await self._shard_pubsub(channel).sunsubscribe(channel)
                    elif self._connected:
                        await self.pubsub.unsubscribe(channel)
                except TRANSIENT as e:  # a fresh connection subscribes only to what is watched
                    log.info("unsubscribe %s: Redis unavailable: %r", channel, e)

    def _shard_pubsub(self, channel: str) -> Any:
        """The pub/sub connection to the master serving `channel`'s slot."""
        node = self.redis.get_node_from_key(channel)
        pubsub = self._shard_pubsubs.get(node.name)
        if pubsub is None:
            pool = aioredis.ConnectionPool(connection_class=node.connection_class,
                                           **{**node.connection_kwargs, "health_check_interval": 15})
            pubsub = self._shard_pubsubs[node.name] = aioredis.Redis(connection_pool=pool).pubsub()
        return pubsub

    async def _shard_subscribe(self, channel: str) -> None:
        pubsub = self._shard_pubsub(channel)
        first = pubsub.connection is None
        await pubsub.ssubscribe(channel)
        if first:  # its read loop starts once it has a connection
            self.spawn(self._read_loop(lambda: pubsub.get_message(timeout=1.0)), f"pub/sub of {channel}'s master")

    def fill_soon(self, w: Watch) -> None:
        if w.filling:
            w.fill_again = True
        else:
            self.spawn(self.fill(w), f"read events of {w.request_id}")

    async def fill(self, w: Watch) -> None:
        """Deliver what the events stream holds from `w.next_seq` on. One fill per watch at a time."""
        if w.filling:
            w.fill_again = True
            return
        w.filling = True
        try:
            while not w.closed:
                w.fill_again = False
                self.metrics.inc("stream_fills_total")
                entries = await self.redis.xrange(self.names.events(w.request_id),
                                                  min=event_stream_id(w.next_seq), count=_FILL_BATCH)
                for _, fields in entries:
                    self._offer_fields(w, fields)
                w.last_activity = time.monotonic()
                if len(entries) < _FILL_BATCH and not w.fill_again:
                    break
        finally:
            w.filling = False

    def _offer_fields(self, w: Watch, fields: dict[Any, Any]) -> None:
        try:
            encoding, raw = split_fields(fields)
            event = decode_payload(encoding, raw)
        except ProtocolError as e:
            log.warning("request %s: unreadable entry in its events stream: %s", w.request_id, e)
            return
        if isinstance(event, dict):
            w.offer(event, _json_text(event, raw, encoding))

    # --- background loops --------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        """Reads the main pub/sub connection; replaces it after an error or when a watch asks."""
        backoff = Backoff("gateway pub/sub", log)
        while not self.closed:
            if not self._connected or self._replace_generation == self.generation:
                try:
                    await self._connect()
                except TRANSIENT as e:
                    self.metrics.inc("redis_errors_total")
                    await backoff.sleep(e)
                    continue
            try:
                msg = await self.pubsub.get_message(timeout=1.0)
            except TRANSIENT as e:
                self._connected = self.ready = False
                self.metrics.inc("redis_errors_total")
                await backoff.sleep(e)
                continue
            except Exception as e:  # a bug in redis-py or here: a fresh connection, never a dead loop
                log.exception("gateway pub/sub: reading failed; replacing the connection")
                self._connected = self.ready = False
                await backoff.sleep(e)
                continue
            backoff.reset()
            if msg is not None:
                self._dispatch(msg)

    async def _read_loop(self, next_message: Callable[[], Awaitable[dict[str, Any] | None]]) -> None:
        """Reads one shard master's pub/sub connection (a cluster), which redis-py reconnects."""
        backoff = Backoff("gateway pub/sub", log)
        reconnected = False
        while not self.closed:
            try:
                msg = await next_message()
                backoff.reset()
            except TRANSIENT as e:
                self.metrics.inc("redis_errors_total")
                reconnected = True
                await backoff.sleep(e)
                continue
            if reconnected:  # messages published while we were away are only in the streams
                reconnected = False
                self._fill_all()
            if msg is not None:
                self._dispatch(msg)

    def _fill_all(self) -> None:
        for readers in list(self.watches.values()):
            for w in list(readers):
                self.fill_soon(w)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg.get("channel") is None:  # a health-check pong
            return
        channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
        kind = msg["type"].decode() if isinstance(msg["type"], bytes) else msg["type"]
        if kind in ("subscribe", "ssubscribe"):
            if channel == self.resumed_channel and self._connected:
                # A fresh connection is live: what was published while none was is only in the streams.
                self.ready = self._replace_generation != self.generation
                self._fill_all()
            confirmed = self._subscribed.get(channel)
            if confirmed is not None:
                confirmed.set()
            return
        if kind not in ("message", "smessage"):
            return
        data = msg["data"]
        if channel == self.resumed_channel:
            self.on_resumed(data.decode(errors="replace"))
            return
        if channel not in self.watches:
            return
        try:
            # JSON events (what the gateway's own jobs get) take the plain decoder: this runs once per
            # token per request, and the worker's output needs no untrusted-input depth checks.
            event = json.loads(data) if data[:1] == b"{" else decode_message(data)
        except (ProtocolError, ValueError) as e:
            log.warning("unreadable message on %s: %s", channel, e)
            return
        if not isinstance(event, dict):
            return
        text = _json_text(event, data, "json" if data[:1] == b"{" else "msgpack")
        for w in list(self.watches.get(channel, ())):
            w.offer(event, text)

    async def _idle_loop(self) -> None:
        """A watch that heard nothing for a while reads its stream: covers any pub/sub message lost
        in a way the read loop could not see."""
        while not self.closed:
            await asyncio.sleep(self.idle_poll_s / 2)
            now = time.monotonic()
            for readers in list(self.watches.values()):
                for w in list(readers):
                    # A job waiting in a long queue stays silent: poll it less and less (up to 16x).
                    if w.last_activity < now - self.idle_poll_s * 2 ** min(w.quiet_polls, 4) and not w.filling:
                        w.last_activity = now
                        w.quiet_polls += 1
                        self.fill_soon(w)
