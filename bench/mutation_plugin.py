"""A pytest plugin that bench/mutation.py copies into each scratch tree and loads with -p (see the
comments there)."""

from __future__ import annotations

import signal

import pytest


def pytest_configure(config):
    # Load the CPU attention extension here, in the fork server, so that the process forked per
    # mutant has it already. Each first load in a process takes torch's build lock (a file); a
    # mutant killed at its timeout while holding it leaves the file behind, and every later load on
    # the machine, plain pytest runs included, then waits for it forever.
    try:
        from streamer_kernels.cpu_attention import load
    except ImportError:
        return
    load()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if not session.config.option.collectonly:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
