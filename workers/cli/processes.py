"""The child processes of `streamer up` and its startup phases, each timed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from workers.cli.parent import PARENT_PID_ENV

STOP_TIMEOUT_S = 15.0


@dataclass
class Child:
    """A `streamer` subcommand running as a child process in its own session."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of ours (STREAMER_* pass through)
    proc: subprocess.Popen | None = None
    asked: bool = False  # SIGTERM sent

    def start(self) -> Child:
        cmd = [sys.executable, "-m", "workers.cli", *self.argv]
        env = {**os.environ, **self.env, PARENT_PID_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        return self

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def ask_to_stop(self) -> None:
        """SIGTERM, once: the child starts stopping (the worker finishes in-flight work within its grace
        period) while the caller asks the others too."""
        if self.proc is not None and self.proc.poll() is None and not self.asked:
            self.proc.send_signal(signal.SIGTERM)
            self.asked = True

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM unless sent already, then SIGKILL if it has not exited within `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.ask_to_stop()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"  {self.name} did not stop within {timeout:.0f}s: killing it", flush=True)
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Phases:
    """Startup time per phase, printed as each one ends."""

    times: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str, what: str) -> Iterator[None]:
        print(f"[{len(self.times) + 1}/4] {what}", flush=True)
        start = time.monotonic()
        yield
        self.times[name] = time.monotonic() - start
        print(f"      {name} ready in {self.times[name]:.1f}s", flush=True)

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.times.items())
        return f"{sum(self.times.values()):.1f}s ({parts})"
