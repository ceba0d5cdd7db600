"""argparse types shared by the commands (`type=` of their options): a value that cannot work is
refused where it is read, as one line saying what to pass instead, never as a traceback later."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

REDIS_SCHEMES = ("redis", "rediss", "unix")


def _port(text: str, zero: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: pass 1-65535 (0: {zero})") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range: pass 1-65535 (0: {zero})")
    return port


def port_number(text: str) -> int:
    """A port to listen on; 0 picks any free one."""
    return _port(text, "any free port")


def optional_port(text: str) -> int:
    """A port for an optional server; 0 turns it off."""
    return _port(text, "off")


def redis_url(text: str) -> str:
    scheme = urlsplit(text).scheme
    if scheme not in REDIS_SCHEMES:
        given = f"a {scheme}:// URL" if scheme else "not a URL"
        raise argparse.ArgumentTypeError(f"{text!r} is {given}: a Redis URL looks like redis://HOST:6379/0 "
                                         "(rediss:// with TLS, unix:///path/redis.sock)")
    return text
