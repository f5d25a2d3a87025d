"""The native-call thread and the foreign-thread → event-loop bridge."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from m2n_async import LocalProtocolError
from m2n_async._data._native import NativeThread, poll_until, wait_threadsafe


@pytest.mark.asyncio
async def test_calls_run_in_order_on_one_thread_without_blocking_the_loop() -> None:
    t = NativeThread("test")
    seen: list[tuple[int, int]] = []
    try:
        calls = [t.submit(lambda i=i: (time.sleep(0.02), seen.append(
            (i, threading.get_ident())))[1], description=f"c{i}") for i in range(5)]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(0.005)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for c in calls:
                await c
            tg.cancel_scope.cancel()
        assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
        assert len({tid for _, tid in seen}) == 1 and seen[0][1] != threading.get_ident()
        assert ticks >= 5  # the loop kept running while the calls slept
    finally:
        assert t.close(5)


@pytest.mark.asyncio
async def test_errors_cancellation_and_close() -> None:
    t = NativeThread("test")
    with pytest.raises(ZeroDivisionError):
        await t.run(lambda: 1 / 0)
    release = threading.Event()
    call = t.submit(release.wait, 10)
    with anyio.move_on_after(0.05) as scope:
        await call  # cancelling the wait leaves the call running
    assert scope.cancelled_caught and not call.done()
    with pytest.raises(LocalProtocolError, match="has not completed"):
        call.result()
    t0 = time.monotonic()
    assert t.close(0.1) is False  # stuck call: bounded, reported, never waited on forever
    assert time.monotonic() - t0 < 5  # far below the 10 s the stuck call would take
    with pytest.raises(LocalProtocolError, match="closed"):
        t.submit(print)
    release.set()
    assert await call is True
    assert t.close(5)


@pytest.mark.asyncio
async def test_wait_threadsafe_and_poll_until() -> None:
    flag = threading.Event()

    def register(cb: object) -> None:
        threading.Timer(0.05, lambda: (flag.set(), cb(None))).start()  # type: ignore[operator]

    with anyio.fail_after(5):
        await wait_threadsafe(register)
    assert flag.is_set()
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    with anyio.fail_after(5):
        await poll_until(done.is_set)
