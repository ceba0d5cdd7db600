"""argparse types shared by the commands (`type=` of their options): a value that cannot work is
refused where it is read, as one line saying what to pass instead, never as a traceback later."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T", int, float)
REDIS_SCHEMES = ("redis", "rediss", "unix")


def _number(text: str, parse: Callable[[str], T], low: T, high: T | None, what: str, allowed: str,
            noun: str = "") -> T:
    """`text` as a number in [low, high] (high None: no bound), or one line saying what to pass."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}: pass {allowed}") from None
    if value < low or (high is not None and value > high):  # type: ignore[operator]
        raise argparse.ArgumentTypeError(f"{noun}{value} is out of range: pass {allowed}")
    return value


def _port(text: str, zero: str) -> int:
    return _number(text, int, 0, 65535, "a port number", f"1-65535 (0: {zero})", noun="port ")


def port_number(text: str) -> int:
    """A port to listen on; 0 picks any free one."""
    return _port(text, "any free port")


def optional_port(text: str) -> int:
    """A port for an optional server; 0 turns it off."""
    return _port(text, "off")


def refresh_seconds(text: str) -> float:
    """Seconds between two refreshes of a live view."""
    return _number(text, float, 0.05, 3600.0, "a number of seconds", "0.05-3600 seconds")


def count(text: str) -> int:
    """A whole number, 0 or more."""
    return _number(text, int, 0, None, "a whole number", "0 or more")


def redis_url(text: str) -> str:
    scheme = urlsplit(text).scheme
    if scheme not in REDIS_SCHEMES:
        given = f"a {scheme}:// URL" if scheme else "not a URL"
        raise argparse.ArgumentTypeError(f"{text!r} is {given}: a Redis URL looks like redis://HOST:6379/0 "
                                         "(rediss:// with TLS, unix:///path/redis.sock)")
    return text


def priority_lanes(text: str) -> tuple[int, ...]:
    """`-10,-1`: the cutoffs of the priority lanes (docs/scheduling.md), negative, in any order."""
    try:
        cutoffs = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers: pass e.g. -10,-1") from None
    if any(c >= 0 for c in cutoffs):
        raise argparse.ArgumentTypeError(f"lane cutoffs must be negative (jobs of the default priority 0 "
                                         f"stay in the default lane), got {text!r}: pass e.g. -10,-1")
    return tuple(cutoffs)
