"""The engine tests' process pool and store: ``m2n_async.testing``'s, with a fixed token.

Spawning a process that imports torch costs seconds on a 2-core machine, so the processes are
started once per test session (``conftest.py``) and reused across cases: each test submits
one job per process (``"engine._scenarios.<name>"`` and its keyword arguments, called with
``_events``/``_index`` added), see ``m2n_async.testing.RankPool``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from m2n_async.testing._world import RankPool
from m2n_async.testing._world import store_thread as _store_thread

__all__ = ["TOKEN", "RankPool", "store_thread"]

TOKEN = "engine-tests-secret"


@contextmanager
def store_thread(token: str = TOKEN) -> Iterator[str]:
    """A ``StoreServer`` on 127.0.0.1 in a background thread; yields its address."""
    with _store_thread(token) as address:
        yield address
