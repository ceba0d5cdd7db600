"""One progress display for long work: `with task("weights", total=n) as bar: ... bar.advance()`.

On a terminal: a bar on stderr (a spinner while `total` is None), replaced at the end by one line
`DESCRIPTION: N/TOTAL done in X.Xs`; not on a terminal only that line, plain text (`summary=False`:
none). STREAMER_PROGRESS=0 forces the plain behaviour, =1 the bar. A task started while a bar is
shown is a second line of it. rich is imported only to draw a bar: importing this costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

_lock = threading.Lock()
_shown: list[Any] = []  # the rich Progress on screen, if any (its tasks: the tasks using it)


def _wants_bar(stream: TextIO) -> bool:
    forced = os.environ.get("STREAMER_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return stream.isatty() and os.environ.get("TERM", "") not in ("dumb", "unknown")
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _same_file(a: TextIO, b: TextIO) -> bool:
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, ValueError, OSError):
        return False


class Task:
    """What `task()` yields: counts the work done, and moves the bar when one is shown."""

    def __init__(self, description: str, total: int | None) -> None:
        self.description, self.total, self.completed = description, total, 0
        self.started = time.monotonic()
        self._progress: Any = None  # the rich Progress and this task's id in it, when shown
        self._id: Any = None

    @property
    def drawn(self) -> bool:
        """Whether a bar shows it (a terminal): callers print their own plain lines otherwise."""
        return self._progress is not None

    def advance(self, n: int = 1) -> None:
        self.completed += n
        if self._progress is not None:
            self._progress.update(self._id, completed=self.completed)

    def update(self, *, completed: int | None = None, total: int | None = None,
               description: str | None = None) -> None:
        renamed = description not in (None, self.description)  # drawn at once: a new phase
        self.completed = self.completed if completed is None else completed
        self.total = self.total if total is None else total
        self.description = description or self.description
        if self._progress is not None:
            self._progress.update(self._id, completed=self.completed, total=self.total,
                                  description=self.description, refresh=renamed)

    def summary_line(self, outcome: str = "done in") -> str:
        done = f"{self.completed}" if self.total is None else f"{self.completed}/{self.total}"
        count = f"{done} " if self.total is not None or self.completed else ""
        return f"{self.description}: {count}{outcome} {time.monotonic() - self.started:.1f}s"


def _start_display(stream: TextIO) -> Any:
    import rich.progress as rp
    from rich.console import Console
    from rich.text import Text

    class Count(rp.ProgressColumn):  # "5/10"; without a total "5" (nothing before the first)
        def render(self, t: Any) -> Text:
            done = f"{t.completed:g}" if t.completed or t.total is not None else ""
            return Text(done if t.total is None else f"{done}/{t.total:g}")

    console = Console(file=stream, force_terminal=True, highlight=False, soft_wrap=True)
    progress = rp.Progress(
        rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(), Count(),
        rp.TaskProgressColumn(), rp.TimeElapsedColumn(), console=console, transient=True,
        refresh_per_second=4, redirect_stderr=stream is sys.stderr,
        redirect_stdout=_same_file(sys.stdout, stream))  # print() to this terminal: above the bar
    progress.start()
    return progress


@contextlib.contextmanager
def task(description: str, total: int | None = None, stream: TextIO | None = None,
         summary: bool = True) -> Iterator[Task]:
    """Show the progress of one piece of long work on `stream` (default: sys.stderr now)."""
    stream = stream or sys.stderr
    handle = Task(description, total)
    with _lock:
        if _shown or _wants_bar(stream):
            if not _shown:
                _shown.append(_start_display(stream))
            handle._progress = _shown[0]
            handle._id = handle._progress.add_task(description, total=total)
    outcome = "done in"
    try:
        yield handle
    except BaseException as exc:
        outcome = "interrupted after" if isinstance(exc, KeyboardInterrupt) else "failed after"
        raise
    finally:
        line, progress, last = handle.summary_line(outcome), handle._progress, True
        if progress is not None:
            with _lock:
                if last := len(progress.tasks) == 1:
                    _shown.clear()
                    progress.stop()  # drawn once more, complete, then erased
                progress.remove_task(handle._id)
        if summary and last:
            print(line, file=stream if progress is None else progress.console.file, flush=True)
        elif summary:
            progress.console.print(line, markup=False)  # above the bars still running
