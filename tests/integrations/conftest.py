"""Fixtures for the ecosystem tests.

``fake_world`` makes this one process rank ``r`` of a pretend world through torch's fake
process group: DeviceMesh, DTensor, FSDP2 and tensor parallelism all construct (collectives
are no-ops), which is what deriving specs needs — layouts come from metadata, not data. Tests
that need real data movement spawn a real Gloo world instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch.distributed as dist


@contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        # Someone else's default group: never tear it down under them.
        pytest.skip("a torch.distributed default group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_world() -> Callable[[int, int], object]:
    """``with fake_world(rank, world_size): ...`` — a pretend torch.distributed world."""
    return _fake_world
