"""Integers and numbers as JSON and msgpack carry them: the one definition the wire contract and the
gateway check values with. The engine keeps its own copy (streamer/sampling_params.py): it imports
nothing of the wire contract."""

from __future__ import annotations

from typing import Any


def is_int(v: Any) -> bool:
    """An integer (not a bool, which Python counts as one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An integer or a float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
