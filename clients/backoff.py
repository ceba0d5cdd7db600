"""Reconnect pacing for Redis loops: exponential backoff with jitter, reset after a success.

Shared by the client and by the server side (worker, gateway): a dropped or restarting Redis is
retried the same way everywhere.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What a dropped or restarting Redis raises; anything else is a bug and must surface.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)

T = TypeVar("T")


class Backoff:
    def __init__(self, name: str, logger: logging.Logger, base: float = 0.05, cap: float = 2.0) -> None:
        self.name, self.log, self.base, self.cap = name, logger, base, cap
        self.failures = 0

    def reset(self) -> None:
        if self.failures:
            self.log.info("%s: Redis reachable again after %d failed attempt(s)", self.name, self.failures)
        self.failures = 0

    async def sleep(self, error: BaseException) -> None:
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** min(self.failures - 1, 16)) * random.uniform(0.5, 1.0)
        level = logging.WARNING if self.failures in (1, 10) or self.failures % 100 == 0 else logging.DEBUG
        self.log.log(level, "%s: Redis unavailable (%s: %s), retry %d in %.2fs", self.name,
                     type(error).__name__, error, self.failures, delay)
        await anyio.sleep(delay)


async def retry(what: str, logger: logging.Logger, call: Callable[[], Awaitable[T]],
                give_up_after_s: float | None = None) -> T:
    """`await call()` until it returns, backing off after each transient Redis error. With
    `give_up_after_s`, the first error after that many seconds is raised instead."""
    backoff = Backoff(what, logger)
    deadline = None if give_up_after_s is None else time.monotonic() + give_up_after_s
    while True:
        try:
            return await call()
        except TRANSIENT as e:
            if deadline is not None and time.monotonic() > deadline:
                raise
            await backoff.sleep(e)
