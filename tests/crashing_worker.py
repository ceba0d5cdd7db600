"""`streamer worker ...` whose process dies on the spot (os._exit, no cleanup: as a segfault in a
kernel or the OOM killer would end it) when the engine runs a step holding a row of a request
whose id starts with "poison". Used by test_worker_poison.py as a real subprocess."""

import os
import sys
from typing import Any

from streamer import llm_engine

_make_executor = llm_engine.make_executor


class CrashingExecutor:
    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)

    def execute(self, scheduled: Any, block_copies: Any = None) -> Any:
        if any(row.seq.request_id.startswith("poison") for row in scheduled):
            os._exit(86)
        return self.executor.execute(scheduled, block_copies)


def crashing_executor(*args: Any, **kwargs: Any) -> CrashingExecutor:
    return CrashingExecutor(_make_executor(*args, **kwargs))


if __name__ == "__main__":
    llm_engine.make_executor = crashing_executor
    from workers.cli.main import main

    sys.exit(main())
