"""What a process holds, for release tests: its threads and open files."""

from __future__ import annotations

import os
import threading
import time

__all__ = ["process_counts"]


def process_counts(settle: float = 2.0) -> tuple[int, int]:
    """``(threads, open fds)`` of this process (Linux ``/proc``), once no joined thread is
    still on its way out.

    ``Thread.join`` returns when the Python side of a thread is done; its OS task goes a
    moment later, and on a loaded machine that moment is long enough to be counted right
    after a ``close()``. So this waits (at most ``settle`` s) until the tasks carrying the
    process's own name — Python threads, and native threads nobody named — are no more than
    the threads ``threading`` knows. A thread that really outlives ``close()`` (a Gloo
    group's) keeps the count up and is counted."""
    deadline = time.monotonic() + settle
    own = _comm("/proc/self/comm")
    while True:
        tasks = os.listdir("/proc/self/task")
        unnamed = sum(_comm(f"/proc/self/task/{t}/comm") == own for t in tasks)
        if unnamed <= threading.active_count() or time.monotonic() > deadline:
            return len(tasks), len(os.listdir("/proc/self/fd"))
        time.sleep(0.01)


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # the task just went
        return ""
