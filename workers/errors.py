"""Errors a user can fix, reported by the CLI as one line saying what to do (no traceback).

The I/O layer's one error module: any command module may raise these; `workers.cli.main.main`
prints `streamer <command>: error: <message>` and exits with status 2. `friendly_message` also
recognises the usual foreign exceptions (the engine's `streamer.errors.ConfigError`, Redis not
reachable, port in use, ...) so modules don't have to wrap every call. Wire errors are in
clients/errors.py, engine errors in streamer/errors.py.
"""

from __future__ import annotations

import errno
import os

import redis.exceptions as rex

from clients.errors import redact_url
from streamer.errors import ConfigError


class UserError(Exception):
    """A mistake in how streamer was started; the message says what to do about it."""


class RedisUnavailable(UserError):
    pass


class ModelNotFound(UserError):
    pass


class UnsupportedModel(UserError):
    pass


class PortInUse(UserError):
    pass


class RedisNotFound(UserError):
    """No redis-server program to start (`streamer up` without --redis)."""


def redis_hint(url: str | None) -> str:
    if url and os.environ.get("STREAMER_REDIS") == url:  # a leftover export, most likely
        return (f"cannot reach Redis at {redact_url(url)}, which STREAMER_REDIS in your environment names: "
                "start that server, point STREAMER_REDIS at a running one, or `unset STREAMER_REDIS` "
                "(`streamer up` then starts a private Redis of its own)")
    where = f" at {redact_url(url)}" if url else ""
    return (f"cannot reach Redis{where}: start redis-server (or use `streamer up`, which starts "
            "one) or pass --redis URL / set STREAMER_REDIS")


def friendly_message(exc: BaseException, redis_url: str | None = None) -> str | None:
    """One line for errors a user can fix; None for anything else (a bug: keep the traceback)."""
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, ConfigError):  # the engine refused its options or the checkpoint
        # Imported only here: the module pulls in torch, which `streamer --help` must not load.
        from streamer.model_config import UnsupportedModelError

        if isinstance(exc, UnsupportedModelError):
            return f"{exc}: use a Llama (2/3), Mistral or Qwen2 checkpoint"
        return f"{exc} (see `streamer worker --help`)"
    if isinstance(exc, rex.AuthenticationError | rex.AuthenticationWrongNumberOfArgsError):
        return ("Redis refused the credentials: put the right password in the URL "
                "(redis://:PASSWORD@HOST:PORT/0) given to --redis / STREAMER_REDIS")
    if isinstance(exc, rex.ConnectionError | rex.TimeoutError):
        return redis_hint(redis_url)
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"address already in use ({exc.strerror}): stop the other program or pass --port N"
    return None
