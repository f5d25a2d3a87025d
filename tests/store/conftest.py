"""Fixtures for the store tests: one ``world`` factory per Store implementation.

``world()`` opens a new session on the same store (a new TCP connection, or a new
``MemoryStore`` session), so the conformance suite can play several processes at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

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
