"""Errors a user can fix, reported by the CLI as one line saying what to do (no traceback).

Any command module may raise these; `workers.cli.main` prints `streamer: error: <message>` and
exits with status 2. `friendly_message` also recognises the usual foreign exceptions (Redis not
reachable, port in use, ...) so modules don't have to wrap every call.
"""

from __future__ import annotations

import errno
import sys


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


def redis_hint(url: str | None) -> str:
    where = f" at {redact_url(url)}" if url else ""
    return (f"cannot reach Redis{where}: start redis-server (or use `streamer up`, which starts "
            "one) or pass --redis URL / set STREAMER_REDIS")


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ':'}***@{host}"


def friendly_message(exc: BaseException, redis_url: str | None = None) -> str | None:
    """One line for errors a user can fix; None for anything else (a bug: keep the traceback)."""
    if isinstance(exc, UserError):
        return str(exc)
    # Engine errors, looked up only if the engine was loaded (importing it here would pull torch).
    model_config = sys.modules.get("streamer.model_config")
    if model_config is not None and isinstance(exc, model_config.UnsupportedModelError):
        return f"{exc}: use a Llama (2/3), Mistral or Qwen2 checkpoint"
    config_error = getattr(sys.modules.get("streamer.errors"), "ConfigError", None)
    if config_error is not None and isinstance(exc, config_error):  # a bad engine option
        return f"{exc} (see `streamer worker --help`)"
    try:
        import redis.exceptions as rex
    except ImportError:  # pragma: no cover - redis is a hard dependency
        rex = None
    if rex is not None:
        if isinstance(exc, rex.AuthenticationError | rex.AuthenticationWrongNumberOfArgsError):
            return ("Redis refused the credentials: put the right password in the URL "
                    "(redis://:PASSWORD@HOST:PORT/0) given to --redis / STREAMER_REDIS")
        if isinstance(exc, rex.ConnectionError | rex.TimeoutError):
            return redis_hint(redis_url)
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"address already in use ({exc.strerror}): stop the other program or pass --port N"
    return None
