"""Errors the engine raises to its callers."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (requests or tokens); retry later or elsewhere."""
