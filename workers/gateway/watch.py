"""One reader of one request's events (`Watch`): each `seq` delivered once, in order, gaps filled.

The relay (relay.py) offers a watch every event it hears on pub/sub or reads from the events stream;
the watch holds events that arrive early and asks its relay to read the stream for a gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

FINAL_TYPES = ("done", "error")
_MAX_OUT_OF_ORDER = 1024  # events held while a gap is filled; past this the stream read covers them


class Relay(Protocol):
    """What a watch asks of the relay that feeds it (relay.EventRelay)."""

    def fill_soon(self, w: Watch) -> None:
        """Read the request's events stream from `w.next_seq` on, in the background."""
        ...

    def unwatch(self, w: Watch) -> None: ...


class Watch:
    """One reader of one request's events. `on_event(event, json_text)` sees each seq once, in order."""

    def __init__(self, relay: Relay, request_id: str, channel: str, next_seq: int,
                 on_event: Callable[[dict[str, Any], str], None]) -> None:
        self.relay, self.request_id, self.channel = relay, request_id, channel
        self.next_seq, self.on_event = next_seq, on_event
        self.held: dict[int, tuple[dict[str, Any], str]] = {}
        self.finished = False
        self.closed = False
        self.last_activity = time.monotonic()
        self.started_ms = time.time() * 1000  # wall clock: compared with other gateways' resume times
        self.filling = False
        self.fill_again = False
        self.quiet_polls = 0  # idle-poll reads in a row that found nothing: the next one waits longer

    def offer(self, event: dict[str, Any], text: str) -> None:
        seq = event.get("seq")
        if self.closed or not isinstance(seq, int) or seq < self.next_seq:
            return  # a duplicate (pub/sub and stream both carry every event)
        if seq > self.next_seq:  # a gap: hold this one and read the missing ones from the stream
            if len(self.held) < _MAX_OUT_OF_ORDER:
                self.held[seq] = (event, text)
            self.relay.fill_soon(self)
            return
        self._deliver(event, text)
        while not self.closed and self.next_seq in self.held:
            self._deliver(*self.held.pop(self.next_seq))

    def _deliver(self, event: dict[str, Any], text: str) -> None:
        self.next_seq += 1
        self.last_activity = time.monotonic()
        self.quiet_polls = 0
        if event.get("type") in FINAL_TYPES:
            self.finished = True
            self.relay.unwatch(self)
        self.on_event(event, text)
