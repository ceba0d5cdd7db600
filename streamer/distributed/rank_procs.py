"""The processes of tensor-parallel ranks 1..N-1: start, watch, stop.

Each rank is `python -m streamer.distributed.rank_main` (a fresh interpreter: the caller's main
module is never re-imported, unlike multiprocessing's spawn). Each gets the write end of its own
pipe, and writes its traceback there if it fails. The parent holds only the read ends, so a
pipe reaches end-of-file exactly when its rank exits, however it exits (even SIGKILL): a
watchdog thread waits on all the pipes at once and, when a rank exits unexpectedly, records why
and kills the other ranks, which makes any collective rank 0 is blocked in fail at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

_MAX_ERROR_CHARS = 6000
_ECHO_GRACE_S = 0.3
_ECHOES = (b"Connection closed by peer", b"Connection reset by peer", b"Broken pipe")


def _is_echo(error: bytes) -> bool:
    """A rank that failed only because a peer went away."""
    return any(e in error for e in _ECHOES)


class RankProcesses:
    def __init__(self, size: int, argv_for_rank: Callable[[int], list[str]], env: dict[str, str]) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._pipes: dict[int, int] = {}  # read end -> rank
        self._errors: dict[int, bytearray] = {}
        self.failure: str | None = None
        self.failed = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        # Called (from the watchdog thread) after a failure, once the other ranks are killed.
        self.on_failure: Callable[[], None] | None = None
        try:
            for rank in range(1, size):
                read_fd, write_fd = os.pipe()
                try:
                    self.procs[rank] = subprocess.Popen(
                        [sys.executable, "-m", "streamer.distributed.rank_main", *argv_for_rank(rank),
                         "--error-fd", str(write_fd)],
                        pass_fds=(write_fd,), env=env)
                finally:
                    os.close(write_fd)
                self._pipes[read_fd] = rank
                self._errors[rank] = bytearray()
        except BaseException:
            self.kill_all()
            self._close_pipes()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="streamer-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    # ---- watching ----------------------------------------------------------------------------
    def _watch(self) -> None:
        open_fds = set(self._pipes)
        while open_fds:
            # The timeout only bounds how late a rank that somehow kept its pipe open is seen.
            ready, _, _ = select.select(list(open_fds), [], [], 0.5)
            for fd in ready:
                data = os.read(fd, 65536)
                if data:
                    self._errors[self._pipes[fd]] += data
                    continue
                open_fds.discard(fd)
                self._exited(self._pipes[fd])
            for fd in list(open_fds):
                if self.procs[self._pipes[fd]].poll() is not None:
                    open_fds.discard(fd)
                    self._exited(self._pipes[fd])
        self._close_pipes()

    def _exited(self, rank: int) -> None:
        proc = self.procs[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        with self._lock:
            if self._closing or self.failure is not None:
                return
        # When one rank dies its peers fail too ("connection closed by peer"), in any order:
        # give them a moment, then blame the rank whose failure is not such an echo.
        time.sleep(_ECHO_GRACE_S)
        exited = [r for r, p in self.procs.items() if r == rank or p.poll() is not None]
        for r in exited:
            self._drain(r)
        cause = next((r for r in exited if not _is_echo(self._errors[r])), rank)
        text = self.describe(cause)
        others = [r for r in exited if r != cause]
        if others:
            text += "\n(then also: " + "; ".join(self.describe(r).split(":\n")[0] for r in others) + ")"
        with self._lock:
            if self._closing or self.failure is not None:
                return
            self.failure = text
        self.kill_all()
        self.failed.set()
        if self.on_failure is not None:
            with contextlib.suppress(Exception):
                self.on_failure()

    def _drain(self, rank: int) -> None:
        """Read what an exited rank left in its pipe (its writer is closed: this cannot block)."""
        fd = next((fd for fd, r in self._pipes.items() if r == rank), None)
        if fd is None:
            return
        with contextlib.suppress(OSError):  # BlockingIOError: a grandchild holds the pipe open
            os.set_blocking(fd, False)
            while data := os.read(fd, 65536):
                self._errors[rank] += data

    def describe(self, rank: int) -> str:
        proc = self.procs[rank]
        code = proc.returncode
        if code is None:
            how = "stopped responding"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        text = f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        detail = self._errors[rank].decode(errors="replace").strip()
        if detail:
            text += ":\n" + detail[-_MAX_ERROR_CHARS:]
        return text

    def wait_for_failure(self, timeout: float) -> str | None:
        """The recorded failure, waiting up to `timeout` s for the watchdog to see one."""
        self.failed.wait(timeout)
        return self.failure

    # ---- stopping ----------------------------------------------------------------------------
    def begin_close(self) -> None:
        """From now on a rank exiting is expected, not a failure."""
        with self._lock:
            self._closing = True

    def join(self, timeout: float) -> None:
        """Wait for every rank to exit (after rank 0 told them to stop); kill what remains."""
        self.begin_close()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every rank still running and reap it, so no process is left behind."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def _close_pipes(self) -> None:
        for fd in list(self._pipes):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipes.clear()
