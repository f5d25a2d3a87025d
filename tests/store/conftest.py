"""Fixtures for the store tests: one ``world`` factory per Store implementation.

``world()`` opens a new session on the same store (a new TCP connection, or a new
``MemoryStore`` session), so the conformance suite can play several processes at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import pytest
import pytest_asyncio
from store_helpers import TOKEN, RunningServer, World

from m2n_async import Store, StoreClient, StoreServer
from m2n_async.testing import MemoryStore


@pytest_asyncio.fixture(params=["memory", "tcp"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    if request.param == "memory":
        root = MemoryStore()

        async def open_memory() -> Store:
            return root.session()

        w = World("memory", root.core, open_memory)
        try:
            yield w
        finally:
            await w.close()
            await root.aclose()
        return
    runner = RunningServer()
    server = await runner.start()

    async def open_tcp() -> Store:
        return await StoreClient.connect(server.address, token=TOKEN)

    w = World("tcp", server.core, open_tcp)
    try:
        yield w
    finally:
        await w.close()
        await runner.stop()


@pytest_asyncio.fixture
async def server() -> AsyncIterator[StoreServer]:
    runner = RunningServer()
    try:
        yield await runner.start()
    finally:
        await runner.stop()


# The TCP server and client are asyncio protocols and must work on any asyncio loop; the
# standalone server runs on uvloop when it is installed. These modules' async tests also run on
# uvloop (the rest only on asyncio, to keep the suite fast); without uvloop they skip visibly.
UVLOOP_MODULES = frozenset({"test_tcp", "test_conformance", "test_session_end",
                            "test_crossed_replies", "test_unacked"})


def _uvloop_factory() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        pytest.skip("uvloop (extra 'fast') is not installed")
    return uvloop.new_event_loop()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    module = getattr(item, "module", None)
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop}
    if module is not None and module.__name__ in UVLOOP_MODULES:
        factories["uvloop"] = _uvloop_factory
    return factories
