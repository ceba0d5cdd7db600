"""`streamer up` and its children (worker, gateway): a child exits when `up` dies without stopping it.

`up` (up.py) sets PARENT_PID_ENV in each child's environment; the child's `main` (main.py) calls
`exit_with_parent`. This module is where both find the name, so neither imports the other.
"""

from __future__ import annotations

import os
import signal
import threading
import time

# Set by `streamer up` for its children (not an option: no STREAMER_ prefix).
PARENT_PID_ENV = "_STREAMER_PARENT_PID"


def exit_with_parent() -> None:
    """In a child of `streamer up`: shut down cleanly (SIGTERM to ourselves) if `up` dies without
    stopping us, e.g. on SIGKILL, so that no worker or gateway is left running on its own."""
    # Left in the environment: the worker re-executes itself to preload tcmalloc (allocator.py)
    # and must keep watching after that. A grandchild inherits the variable too, but its parent
    # is not `up`, so the pid check below leaves it alone.
    pid = os.environ.get(PARENT_PID_ENV, "")
    if not pid.isdigit() or os.getppid() != int(pid):
        return

    def watch() -> None:
        while os.getppid() == int(pid):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
