"""The native-call thread and the bridge from foreign threads into the event loop.

Theory of operation: every blocking or thread-affine native call of one engine (Gloo
send/recv waits, NCCL communicator calls, ``nccl.m2n`` reshards and groups) runs on ONE
dedicated OS thread per engine, in submission order. One thread, because M2N group state is
per OS thread and NCCL point-to-point calls must be issued in the same order on every rank;
dedicated, because anyio's ``to_thread`` pool is shared by everybody (40 threads) and a call
blocked inside NCCL must neither starve it nor block the event loop.

``NativeThread.submit(fn, *args)`` enqueues a call and returns a ``NativeCall``: a small
thread-safe future. The event loop awaits it with ``await call.wait()`` (or ``await call``);
completion crosses into the loop through the loop's own thread-safe wakeup
(``call_soon_threadsafe`` on asyncio, ``run_sync_soon`` on trio), so nothing spins and the
loop never blocks. ``wait_threadsafe`` exposes the same bridge for any other completion source
(e.g. a CUDA-event watcher thread in the GPU transports), and ``poll_until`` is the fallback
for sources that can only be polled (``torch.cuda.Event.query``), with exponential backoff.

Cancellation: cancelling a coroutine that awaits a ``NativeCall`` only stops the *waiting*;
the native call keeps running on its thread (a native call cannot be interrupted). To make a
blocked call return, abort the resource it is blocked on (the transport's ``abort()``), then
``NativeThread.close(timeout)`` joins the thread with a bound; a thread that is still stuck
after that is a daemon thread and is reported, never waited on forever.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from m2n_async._proto.errors import LocalProtocolError

__all__ = ["NativeCall", "NativeThread", "poll_until", "threadsafe_notifier", "wait_threadsafe"]

T = TypeVar("T")

_STOP = object()


class NativeCall(Generic[T]):
    """The pending result of one call submitted to a ``NativeThread``.

    Thread-safe: ``done``, ``result`` and ``add_done_callback`` may be used from any thread;
    ``wait`` must be awaited from an event loop (asyncio or trio through anyio).
    """

    __slots__ = ("_callbacks", "_done", "_event", "_exc", "_lock", "_result", "description")

    def __init__(self, description: str) -> None:
        self.description = description
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._done = False
        self._result: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[NativeCall[T]], None]] = []

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<NativeCall {self.description!r} {state}>"

    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        """The call's return value; re-raises its exception. Only valid once ``done()``."""
        if not self._done:
            raise LocalProtocolError(f"native call {self.description!r} has not completed")
        if self._exc is not None:
            raise self._exc
        return self._result  # type: ignore[no-any-return]

    def exception(self) -> BaseException | None:
        if not self._done:
            raise LocalProtocolError(f"native call {self.description!r} has not completed")
        return self._exc

    def add_done_callback(self, fn: Callable[[NativeCall[T]], None]) -> None:
        """Run ``fn(self)`` once done: at once (this thread) if already done, else on the
        completing thread. Callbacks must be quick and must not raise."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def join(self, timeout: float | None = None) -> bool:
        """Block THIS thread until done or ``timeout`` seconds; whether it is done. For other
        helper threads only — never call it on the event loop (use ``wait``)."""
        return self._event.wait(timeout)

    def _set(self, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            self._result, self._exc, self._done = result, exc, True
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a broken callback must not kill the native thread
                pass

    async def wait(self) -> T:
        """Await completion from the event loop without blocking it; return or re-raise.

        Cancellation: only the waiting stops; the call itself keeps running on the native
        thread until it returns (abort the resource it is blocked on to make it return).
        """
        if not self._done:
            await wait_threadsafe(self.add_done_callback)
        else:
            await anyio.lowlevel.checkpoint()
        return self.result()

    def __await__(self) -> Generator[Any, None, T]:
        return self.wait().__await__()


class NativeThread:
    """One dedicated daemon thread running submitted calls in order (see module docstring)."""

    def __init__(self, name: str, *, nice: int = 0) -> None:
        """``nice`` > 0 lowers this thread's CPU priority (Linux; ignored elsewhere): bulk
        copy threads yield to the event loop on an oversubscribed machine."""
        self.name = name
        self._nice = nice
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._current: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"m2n-native-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<NativeThread {self.name!r} running={self._current!r} closed={self._closed}>"

    @property
    def current_call(self) -> str | None:
        """Description of the call running now (for hang diagnostics), or None."""
        return self._current

    def is_current(self) -> bool:
        """True when called from this native thread (transports assert thread affinity)."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args: Any, description: str = "") -> NativeCall[T]:
        """Enqueue ``fn(*args)``; calls run one at a time in submission order."""
        call: NativeCall[T] = NativeCall(description or getattr(fn, "__qualname__", repr(fn)))
        with self._lock:
            if self._closed:
                raise LocalProtocolError(
                    f"native thread {self.name!r} is closed; cannot run {call.description!r}")
            self._queue.put((fn, args, call))
        return call

    async def run(self, fn: Callable[..., T], *args: Any, description: str = "") -> T:
        """Submit and await. Cancellation: as ``NativeCall.wait`` (the call keeps running)."""
        return await self.submit(fn, *args, description=description).wait()

    def close(self, timeout: float) -> bool:
        """Stop accepting calls, let queued ones finish, and join for at most ``timeout`` s.

        Returns True when the thread ended. Never blocks longer than ``timeout``: a thread
        stuck in a native call is a daemon and is left behind (the caller reports it).
        Idempotent; callable from any thread except this native thread itself.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if self.is_current():
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        # Autograd off on this thread (grad mode is per thread): its copies read sources and
        # write targets that may be parameters requiring grad, where autograd would refuse
        # an in-place write into a leaf, or record a graph nobody uses.
        import torch

        torch.set_grad_enabled(False)
        if self._nice > 0 and hasattr(os, "setpriority"):
            try:  # per thread on Linux: PRIO_PROCESS with the thread's own id
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError:
                pass
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args, call = item
            self._current = call.description
            try:
                result = fn(*args)
            except BaseException as exc:  # delivered to the awaiting side, never lost
                call._set(None, exc)
            else:
                call._set(result, None)
            finally:
                self._current = None
            del fn, args, call, item  # drop buffer references as soon as the call is done


def threadsafe_notifier(fn: Callable[[], None]) -> Callable[[], None]:
    """Wrap ``fn`` (which must run on the current event loop's thread) into a callable that
    any thread may invoke without blocking; the call is scheduled on the loop.

    Must be created from inside the event loop. Calls after the loop closed are dropped.
    """
    native = anyio.lowlevel.current_token().native_token
    schedule: Callable[[Callable[[], None]], object]
    if hasattr(native, "call_soon_threadsafe"):  # asyncio loop
        schedule = native.call_soon_threadsafe
    elif hasattr(native, "run_sync_soon"):  # trio token
        schedule = native.run_sync_soon
    else:  # pragma: no cover - an anyio backend we do not know
        raise LocalProtocolError(f"unsupported event loop token {native!r}")

    def notify() -> None:
        try:
            schedule(fn)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass

    return notify


async def wait_threadsafe(register: Callable[[Callable[[Any], None]], object]) -> None:
    """Await a completion signalled from another thread.

    ``register(cb)`` must arrange for ``cb(anything)`` to be called exactly once, from any
    thread, when the completion happens (or at once if it already happened) — e.g.
    ``NativeCall.add_done_callback`` or a CUDA-event watcher's ``add_done_callback``.

    Cancellation: stops waiting; a late signal is dropped harmlessly.
    """
    event = anyio.Event()
    notify = threadsafe_notifier(event.set)
    register(lambda _arg: notify())
    await event.wait()


async def poll_until(done: Callable[[], bool], *, first: float = 50e-6,
                     maximum: float = 2e-3) -> None:
    """Await ``done()`` becoming true by polling with exponential backoff.

    For completion sources that cannot call back (``torch.cuda.Event.query``). The interval
    starts at ``first`` seconds and doubles up to ``maximum``, so short waits are answered
    quickly and long ones cost little CPU.

    Cancellation: stops polling at once; nothing else is affected.
    """
    interval = first
    while not done():
        await anyio.sleep(interval)
        interval = min(interval * 2, maximum)
