"""Fixtures: the FAKE nccl runtime (tests/dataplanes/fake_nccl.py) installed for one test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from m2n_async._data import _cuda

from . import fake_nccl


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_nccl.FakeWorld]:
    monkeypatch.delenv(_cuda.GROUPING_ENV, raising=False)
    world = fake_nccl.FakeWorld()
    saved = fake_nccl.install(world)
    _cuda.reset_import_cache()
    try:
        yield world
    finally:
        fake_nccl.uninstall(saved)
        _cuda.reset_import_cache()
