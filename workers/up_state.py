"""Where a running `streamer up` is: a small file in the user's cache directory, written once it is up
and removed when it stops, so `streamer generate`, `top` and `dead` find its private Redis (on a port
it picked) without being told. The file may hold a password in the Redis URL: only its owner reads it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from streamer.cache_dir import cache_dir


def state_path() -> Path:
    return cache_dir() / "up.json"


def record(redis_url: str, prefix: str, gateway_url: str) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "redis": redis_url, "prefix": prefix, "gateway": gateway_url}))
    tmp.chmod(0o600)
    tmp.replace(path)  # whole or not at all, for a reader at the same moment


def forget() -> None:
    """Remove the file if it is this process's (a later `up` may have replaced it)."""
    state = _read()
    if state is not None and state.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            state_path().unlink()


def running_up() -> dict[str, Any] | None:
    """The running `up`'s {"pid", "redis", "prefix", "gateway"}; None when none runs (a file left by
    one that was killed names a dead process)."""
    state = _read()
    if state is None or not isinstance(state.get("pid"), int) or not isinstance(state.get("redis"), str):
        return None
    try:
        os.kill(state["pid"], 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return state


def _read() -> dict[str, Any] | None:
    try:
        state = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
