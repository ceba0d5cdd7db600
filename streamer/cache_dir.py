"""Where streamer keeps what it derives from checkpoints (converted models, resolved configs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$STREAMER_CACHE`, else `$XDG_CACHE_HOME/streamer`, else `~/.cache/streamer`."""
    if os.environ.get("STREAMER_CACHE"):
        return Path(os.environ["STREAMER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "streamer"
