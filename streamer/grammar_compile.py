"""Compiling structured_outputs specs in child processes, with a time limit.

xgrammar's compile cannot be interrupted, and some specs under the size limit compile for tens of
seconds (a schema of 2,000 optional properties: 10-45 s on a 49k vocabulary). A compile therefore
runs in a child process (streamer/grammar_child.py) that is killed when the limit passes: the CPU
comes back at once, and the request alone is refused. The children run at a lower CPU priority,
and there are at most `workers` of them: more compiles at once wait for one, on their callers'
threads, never on the engine's step or the tokenizing thread.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

from streamer.errors import GrammarError

CHILD = Path(__file__).with_name("grammar_child.py")
START_TIMEOUT_S = 120.0  # importing xgrammar in a fresh process (torch comes with it); not a compile's time


class CompileTimeout(GrammarError):
    """A spec took longer to compile than the limit allows."""


class _Child:
    """One compile process and the pipes to it."""

    def __init__(self, tokenizer_info: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self._buffer = b""
        try:
            self._send(tokenizer_info)
            self.read(START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def ask(self, method: str, source: str, timeout_s: float) -> dict:
        self._send(json.dumps({"method": method, "source": source}))
        return self.read(timeout_s)

    def read(self, timeout_s: float) -> dict:
        """The child's next line; TimeoutError when none comes in time, EOFError when it died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError("the compile process exited")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class CompilePool:
    """At most `workers` compile processes, started when first needed and reused."""

    def __init__(self, tokenizer_info: str, workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._tokenizer_info = tokenizer_info
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False

    def compile(self, method: str, source: str, what: str) -> str:
        """The compiled grammar, serialized; GrammarError (CompileTimeout past the limit) naming `what`."""
        with self._slots:
            child = self._take()
            try:
                answer = child.ask(method, source, self.timeout_s)
            except TimeoutError:
                child.kill()
                raise CompileTimeout(f"{what} took over the compile limit of {self.timeout_s:g} s "
                                     "(grammar_compile_timeout_s) and was stopped") from None
            except (EOFError, OSError) as e:
                child.kill()
                raise GrammarError(f"{what} could not be compiled: {e}") from None
            self._give_back(child)
        if "error" in answer:
            raise GrammarError(f"{what} does not compile: {answer['error']}"[:500])
        return answer["ok"]

    def _take(self) -> _Child:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Child(self._tokenizer_info)

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()
