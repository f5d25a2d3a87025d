"""The pytest plugin (entry point ``pytest11``: ``m2n_async``): fixtures for the store and the
local world.

Theory of operation: every fixture here is synchronous, so it serves pytest-asyncio tests in
strict mode and anyio's pytest plugin alike — neither owns a loop these fixtures need. The
store fixtures hand out things an async test uses in its own loop (a ``MemoryStore`` binds to
no loop until its first call; the TCP store runs in its own thread). Worlds are costly to
start (each rank process imports torch), so ``m2n_world(trainers, workers)`` keeps one world
per size for the whole session, on the session's TCP store, and every run gets a fresh job
name; from an async test call ``await world.arun(fn, ...)``.

Fixtures:

- ``m2n_memory_store``: a fresh ``MemoryStore`` (one session; ``.session()`` opens more).
- ``m2n_store``: the session's ``StoreServer`` on 127.0.0.1 (in a thread), as
  ``LocalStore(address, token)``; ``await m2n_store.connect()`` opens a ``StoreClient``.
- ``m2n_world``: ``m2n_world(trainers, workers) -> LocalWorld``, shared per size.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from m2n_async.testing._memory import MemoryStore
from m2n_async.testing._world import LocalWorld, store_thread

__all__ = ["LocalStore", "m2n_memory_store", "m2n_store", "m2n_world"]


@dataclass(frozen=True)
class LocalStore:
    """A store server this test session runs: where it is and its token."""

    address: str
    token: str

    async def connect(self) -> Any:
        """A new ``StoreClient`` session on it (close it with ``aclose``)."""
        from m2n_async._store import StoreClient

        return await StoreClient.connect(self.address, token=self.token)


@pytest.fixture
def m2n_memory_store() -> MemoryStore:
    """A fresh in-memory store for one test."""
    return MemoryStore()


@pytest.fixture(scope="session")
def m2n_store() -> Iterator[LocalStore]:
    """The session's TCP store on 127.0.0.1."""
    token = secrets.token_hex(16)
    with store_thread(token) as address:
        yield LocalStore(address, token)


@pytest.fixture(scope="session")
def _m2n_worlds(m2n_store: LocalStore) -> Iterator[dict[tuple[int, int], LocalWorld]]:
    worlds: dict[tuple[int, int], LocalWorld] = {}
    try:
        yield worlds
    finally:
        for w in worlds.values():
            w.close()


@pytest.fixture
def m2n_world(_m2n_worlds: dict[tuple[int, int], LocalWorld], m2n_store: LocalStore
              ) -> Callable[[int, int], LocalWorld]:
    """``m2n_world(trainers, workers)``: the session's world of that size (started on first
    use; its processes are reused, one that died is replaced before the next run)."""

    def get(trainers: int, workers: int) -> LocalWorld:
        key = (trainers, workers)
        if key not in _m2n_worlds:
            _m2n_worlds[key] = LocalWorld(trainers, workers, store_address=m2n_store.address,
                                          token=m2n_store.token)
        return _m2n_worlds[key]
    return get
