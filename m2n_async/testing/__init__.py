"""Public test helpers: an in-memory store, a local multi-process world, fault points,
assertions on the failure contract and what a process holds (docs/testing.md)."""

from m2n_async._engine._faults import Fault, InjectedFault
from m2n_async.testing._assertions import (
    assert_committed,
    assert_not_committed,
    assert_same_failure,
)
from m2n_async.testing._memory import MemoryStore
from m2n_async.testing._resources import process_counts
from m2n_async.testing._world import (
    LocalWorld,
    RankContext,
    RankEvent,
    RankExitedError,
    RankPool,
    RankResult,
    RankStartError,
    RankStartTimeout,
    WorldHangError,
    WorldResult,
    store_thread,
)

__all__: list[str] = [
    "Fault",
    "InjectedFault",
    "LocalWorld",
    "MemoryStore",
    "RankContext",
    "RankEvent",
    "RankExitedError",
    "RankPool",
    "RankResult",
    "RankStartError",
    "RankStartTimeout",
    "WorldHangError",
    "WorldResult",
    "assert_committed",
    "assert_not_committed",
    "assert_same_failure",
    "process_counts",
    "store_thread",
]
