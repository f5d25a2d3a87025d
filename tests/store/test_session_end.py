"""A client that goes away ends its session at once, however it goes.

The engine relies on this for fail-fast: every collective watches the peers' liveness keys,
so a rank whose store connection breaks (``_break`` after a protocol error), is closed
(``aclose``) or whose process exits must make the other ranks' waits fail with
``PeerLostError`` within moments — not after their deadlines.
"""

from __future__ import annotations

import os
import sys
import time

import anyio
import anyio.abc
import pytest
from store_helpers import TOKEN, wait_ready

from m2n_async import (
    M2NError,
    PeerLostError,
    RemoteProtocolError,
    StoreClient,
    StoreError,
    StoreServer,
)

pytestmark = pytest.mark.asyncio

#: Loopback delivers a lost peer in milliseconds; the bound leaves room for a busy CI box.
PROMPT = 2.0


class Watcher:
    """Another session's gather that watches ``key``; records when it saw the loss."""

    def __init__(self, store: StoreClient, key: str) -> None:
        self.store = store
        self.key = key
        self.lost_at: float | None = None
        self.error: PeerLostError | None = None

    async def run(self) -> None:
        try:
            await self.store.gather("never/", 1, watch=[self.key])
        except PeerLostError as exc:
            self.error = exc
            self.lost_at = time.monotonic()

    async def wait_lost(self, since: float) -> float:
        with anyio.fail_after(10):
            while self.lost_at is None:  # noqa: ASYNC110 - polled with a bound
                await anyio.sleep(0.005)
        assert self.error is not None and self.error.key == self.key
        return self.lost_at - since


async def test_broken_client_ends_its_session(server: StoreServer) -> None:
    """``_break`` (what a client does on a reply it cannot match) with calls in flight."""
    victim = await StoreClient.connect(server.address, token=TOKEN)
    other = await StoreClient.connect(server.address, token=TOKEN)
    await victim.set("alive/v", b"1", ephemeral=True)
    watcher = Watcher(other, "alive/v")
    failures: list[BaseException] = []

    async def in_flight() -> None:
        try:
            await victim.get("never", wait=True, watch=["alive/other"])
        except M2NError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher.run)
        tg.start_soon(in_flight)
        with anyio.fail_after(10):
            while server.core.pending_waiters < 2:  # noqa: ASYNC110 - both are registered
                await anyio.sleep(0.005)
        t0 = time.monotonic()
        victim._break(RemoteProtocolError("test: unmatched reply"))
        assert await watcher.wait_lost(t0) < PROMPT
    assert len(failures) == 1 and "unmatched reply" in str(failures[0])
    assert "alive/v" not in server.core.keys()
    with anyio.fail_after(10):
        while server.connections != 1:  # noqa: ASYNC110 - the server dropped the victim
            await anyio.sleep(0.005)
    await victim.aclose()
    await other.aclose()


async def test_sever_all_breaks_every_open_client_of_the_process(server: StoreServer) -> None:
    """The ``disconnect`` fault's cut: every open client of this process at once, a closed
    one left alone; the server ends their sessions (ephemeral keys go) and their next calls
    fail, naming the cut."""
    from m2n_async._store._client import sever_all

    a = await StoreClient.connect(server.address, token=TOKEN)
    b = await StoreClient.connect(server.address, token=TOKEN)
    closed = await StoreClient.connect(server.address, token=TOKEN)
    await closed.aclose()
    await a.set("alive/a", b"1", ephemeral=True)
    assert sever_all("test") == 2
    with anyio.fail_after(10):
        while "alive/a" in server.core.keys() or server.connections:  # noqa: ASYNC110
            await anyio.sleep(0.005)
    for client in (a, b):
        with pytest.raises(StoreError, match="severed: test"):
            await client.get("x")
        await client.aclose()


async def test_aclose_ends_session_even_when_the_server_stopped_reading_us(
        server: StoreServer) -> None:
    """A client that did not read its replies for a while (its loop was busy) has made the
    server stop reading it; its own requests then pile up unsent. ``aclose`` must still end
    the session: a graceful close would wait for a flush that never comes."""
    victim = await StoreClient.connect(server.address, token=TOKEN)
    other = await StoreClient.connect(server.address, token=TOKEN)
    big = b"b" * (1 << 20)
    await victim.set("big", big)
    await victim.set("alive/v", b"1", ephemeral=True)
    watcher = Watcher(other, "alive/v")
    (proto,) = [p for p in server._protocols
                if p._session is not None and p._session.id == victim.session]

    async def call(coro_fn: object) -> None:
        try:
            await coro_fn()  # type: ignore[operator]
        except StoreError:
            pass  # failed by aclose

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher.run)
        victim._transport.pause_reading()  # the victim's loop "is busy": replies pile up
        with anyio.fail_after(30):
            while not proto._paused:
                tg.start_soon(call, lambda: victim.get("big"))
                await anyio.sleep(0.02)
            i = 0
            while victim._transport.get_write_buffer_size() == 0:
                i += 1
                tg.start_soon(call, lambda i=i: victim.set(f"s/{i}", big))
                await anyio.sleep(0.02)
        t0 = time.monotonic()
        await victim.aclose()
        assert await watcher.wait_lost(t0) < PROMPT
    assert "alive/v" not in server.core.keys()
    await other.aclose()


VICTIM = """
import os, sys, anyio
from m2n_async import StoreClient

async def main(address, token):
    client = await StoreClient.connect(address, token=token)
    await client.set("alive/v", b"1", ephemeral=True)
    pending = client.get("never", wait=True)  # exits with a request in flight
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: pending)
        print("READY", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        os._exit(0)  # no aclose, no loop teardown: the kernel closes the socket

anyio.run(main, sys.argv[1], sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process handling")
async def test_process_exit_without_close_ends_its_session(server: StoreServer) -> None:
    other = await StoreClient.connect(server.address, token=TOKEN)
    watcher = Watcher(other, "alive/v")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    async with await anyio.open_process(
            [sys.executable, "-c", VICTIM, server.address, TOKEN], env=env) as proc:
        assert proc.stdin is not None
        await wait_ready(proc)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher.run)
            with anyio.fail_after(10):
                while server.core.pending_waiters < 2:  # noqa: ASYNC110 - both registered
                    await anyio.sleep(0.005)
            await proc.stdin.send(b"exit\n")
            with anyio.fail_after(30):
                await proc.wait()
            t_exit = time.monotonic()
            assert await watcher.wait_lost(t_exit) < PROMPT
    assert proc.returncode == 0
    assert server.core.pending_waiters == 0
    await other.aclose()
