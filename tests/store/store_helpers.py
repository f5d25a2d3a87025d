"""Shared helpers of the store tests (a uniquely named module: tests dirs are not packages)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from m2n_async import Store, StoreClient, StoreServer
from m2n_async._store._core import StoreCore

TOKEN = "test-token-\u00e9"  # non-ASCII on purpose: tokens are UTF-8


async def healthy(server: StoreServer, deadline: float) -> None:
    """The server still serves a well-behaved client (within ``deadline`` seconds)."""
    with anyio.fail_after(deadline):
        async with await StoreClient.connect(server.address, token=TOKEN) as c:
            await c.set("health", b"ok")
            assert await c.get("health") == b"ok"


class World:
    """Sessions on one store, plus a view of its core state for white-box assertions."""

    def __init__(self, kind: str, core: StoreCore,
                 opener: Callable[[], Awaitable[Store]]) -> None:
        self.kind = kind
        self.core = core
        self._opener = opener
        self.sessions: list[Store] = []

    async def session(self) -> Store:
        store = await self._opener()
        self.sessions.append(store)
        return store

    async def close(self) -> None:
        for store in self.sessions:
            await store.aclose()


class RunningServer:
    """A StoreServer run in its own asyncio task.

    pytest-asyncio may finalize an async fixture in a different task than the one that set it
    up, and an anyio task group (which the server holds) must be exited by the task that
    entered it; a dedicated task sidesteps that.
    """

    def __init__(self, **kwargs: object) -> None:
        self._kwargs = kwargs
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.server: StoreServer | None = None

    async def start(self) -> StoreServer:
        ready = asyncio.Event()

        async def run() -> None:
            kwargs = {"token": TOKEN, **self._kwargs}
            async with StoreServer("127.0.0.1", 0, **kwargs) as srv:  # type: ignore[arg-type]
                self.server = srv
                ready.set()
                await self._stop.wait()

        self._task = asyncio.create_task(run())
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({self._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.server is None:
            await self._task  # raises the startup error
            raise RuntimeError("store server did not start")
        return self.server

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


async def wait_ready(proc: Any) -> None:
    """Read a spawned helper's stdout until it prints READY (its client is connected)."""
    assert proc.stdout is not None
    with anyio.fail_after(60):  # interpreter start-up on a busy box
        seen = b""
        async for chunk in proc.stdout:
            seen += chunk
            if b"READY" in seen:
                break
    assert b"READY" in seen


async def errors_while(call: Callable[[], Awaitable[object]],
                       action: Callable[[], Awaitable[object]],
                       expected: type[BaseException], *, pause: float = 0.05,
                       deadline: float = 10.0) -> list[BaseException]:
    """Start the blocking ``call``, let it reach the store (``pause`` s), run ``action``,
    and return the ``expected`` errors the call raised (bounded by ``deadline``)."""
    caught: list[BaseException] = []

    async def waiter() -> None:
        try:
            await call()
        except expected as exc:
            caught.append(exc)

    with anyio.fail_after(deadline):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(pause)
            await action()
    return caught
