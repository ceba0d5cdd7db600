"""Errors the engine raises to its callers: the engine layer's only error module."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (requests or tokens); retry later or elsewhere."""


class ConfigError(ValueError):
    """The engine cannot start with these options (a user-fixable mistake, not a bug)."""


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine cannot serve more requests."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine that owned it cannot run any more."""


class GrammarError(ValueError):
    """A request's structured_outputs spec does not compile (invalid schema, regex or grammar)."""
