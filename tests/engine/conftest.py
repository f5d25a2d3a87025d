"""Session-wide fixtures: one pool of rank processes and one TCP store for all engine tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from ._world import RankPool, store_thread

POOL_SIZE = 5  # the largest world a test uses (e.g. 2 trainers + 3 workers)
_jobs = itertools.count()


@pytest.fixture(scope="session")
def pool() -> Iterator[RankPool]:
    p = RankPool(POOL_SIZE)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session")
def store_address() -> Iterator[str]:
    with store_thread() as address:
        yield address


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A fresh store namespace per test (jobs never share keys or generations)."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    return f"t{next(_jobs)}-{name}"[:120]
