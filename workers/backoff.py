"""Reconnect pacing for Redis loops: exponential backoff with jitter, reset after a success."""

from __future__ import annotations

import logging
import random

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What a dropped or restarting Redis raises; anything else is a bug and must surface.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)


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
