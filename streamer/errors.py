"""Errors the engine raises to its callers."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (requests or tokens); retry later or elsewhere."""


class ConfigError(ValueError):
    """The engine cannot start with these options (a user-fixable mistake, not a bug)."""
