"""``StoreServer.in_thread``: a store served from an event loop thread of its own."""

from __future__ import annotations

import os
import threading
import warnings

import anyio
import anyio.to_thread
import pytest
from store_helpers import TOKEN

from m2n_async import StoreClient, StoreError, StoreServer, StoreThread


def _store_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "m2n-async-store"]


@pytest.mark.asyncio
async def test_serves_clients_of_this_loop_and_of_other_threads() -> None:
    before = len(_store_threads())
    with StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="asyncio") as served:
        assert isinstance(served, StoreThread)
        assert served.address.startswith("127.0.0.1:")
        assert len(_store_threads()) == before + 1
        assert repr(served) == f"<StoreThread {served.address} serving>"
        client = await StoreClient.connect(served.address, token=TOKEN)
        try:
            await client.set("k", b"from the test's loop")

            async def other_thread() -> bytes | None:
                other = await StoreClient.connect(served.address, token=TOKEN)
                try:
                    await other.set("k2", b"from another thread")
                    return await other.get("k", wait=True)
                finally:
                    await other.aclose()

            got = await anyio.to_thread.run_sync(lambda: anyio.run(other_thread))
            assert got == b"from the test's loop"
            assert await client.get("k2") == b"from another thread"
            assert served.server.connections == 1
        finally:
            await client.aclose()
    assert served.closed
    assert repr(served).endswith(" closed>")
    assert len(_store_threads()) == before  # the thread ended with close()


@pytest.mark.asyncio
async def test_close_ends_the_clients_sessions_and_is_idempotent() -> None:
    served = StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="asyncio")
    client = await StoreClient.connect(served.address, token=TOKEN)
    try:
        waiting: list[BaseException] = []

        async def wait_for_key() -> None:
            try:
                await client.get("never", wait=True)
            except StoreError as exc:  # PeerLostError is one
                waiting.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_key)
            await anyio.sleep(0.05)
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(served.close)
        assert waiting, "a waiter of a closed store must fail, not hang"
        served.close()  # again: nothing to do
        with pytest.raises(StoreError, match="cannot connect"), anyio.fail_after(10):
            await StoreClient.connect(served.address, token=TOKEN)
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_close_from_the_store_thread_is_refused() -> None:
    served = StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="asyncio")
    try:
        # a callback on the store's own loop (a user's hook there, say) must not wait for it
        refused: list[BaseException] = []

        def close_on_store_thread() -> None:
            try:
                served.close()
            except StoreError as exc:
                refused.append(exc)

        done = threading.Event()
        served.server._accepting.get_loop().call_soon_threadsafe(  # type: ignore[union-attr]
            lambda: (close_on_store_thread(), done.set()))
        assert done.wait(10)
        assert refused and "own thread" in str(refused[0])
        assert not served.closed
    finally:
        served.close()


@pytest.mark.asyncio
async def test_refusals() -> None:
    server = StoreServer("127.0.0.1", 0, token=TOKEN)
    with pytest.raises(ValueError, match="loop must be 'auto', 'asyncio' or 'uvloop'"):
        server.in_thread(loop="trio")
    with server.in_thread(loop="asyncio"):
        with pytest.raises(StoreError, match="already running"):
            server.in_thread(loop="asyncio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="uvloop is not installed"):
            StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="uvloop")
    else:
        with StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="uvloop") as served:
            client = await StoreClient.connect(served.address, token=TOKEN)
            await client.set("k", b"v")
            await client.aclose()


@pytest.mark.asyncio
async def test_a_bind_failure_leaves_no_thread() -> None:
    with StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="asyncio") as taken:
        port = int(taken.address.rsplit(":", 1)[1])
        before = len(_store_threads())
        with pytest.raises(StoreError, match="cannot listen"):
            StoreServer("127.0.0.1", port, token=TOKEN).in_thread(loop="asyncio")
        assert len(_store_threads()) == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_close_in_a_forked_child_leaves_the_parents_server_serving() -> None:
    with StoreServer("127.0.0.1", 0, token=TOKEN).in_thread(loop="asyncio") as served:
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: intended
            pid = os.fork()
        if pid == 0:  # the child: the store thread is not here, so close() must not wait
            try:
                served.close()
                os.write(w, b"ok" if served.closed else b"no")
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as got:
            assert got.read() == b"ok"
        assert os.waitpid(pid, 0)[1] == 0
        assert not served.closed

        async def still_served() -> bytes | None:
            client = await StoreClient.connect(served.address, token=TOKEN)
            try:
                await client.set("k", b"v")
                return await client.get("k")
            finally:
                await client.aclose()

        assert anyio.run(still_served) == b"v"
