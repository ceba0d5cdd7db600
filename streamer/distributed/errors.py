"""Errors of the tensor-parallel executor."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine that owned it cannot run any more."""
