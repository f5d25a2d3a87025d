"""A ``StoreServer`` served from an event loop thread of its own (``StoreServer.in_thread``).

Why a thread: a server in the event loop of a process that also trains (trainer rank 0's,
say) answers every rank between that loop's own steps, and no one while that loop is blocked
by synchronous work; a synchronous training script has no event loop to serve it from at all.
On a loop thread of its own the store answers whenever the GIL is free, as a server in a
process of its own (``m2n-async store``) does (docs/tuning.md §5 and BENCHMARKS "Coalesced
reshards" compare the three hostings). The thread is anyio's blocking portal
(``anyio.from_thread.start_blocking_portal``): a daemon thread, so a handle never closed
cannot hold the interpreter at exit.
"""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from anyio.from_thread import start_blocking_portal

from m2n_async._proto.errors import StoreError

if TYPE_CHECKING:
    from m2n_async._store._server import StoreServer

__all__ = ["StoreThread"]


class StoreThread:
    """A running ``StoreServer`` on an event loop thread of its own; made by
    ``StoreServer.in_thread()``, which returns once the server listens.

    ``address`` is ``"host:port"`` for ``StoreClient.connect`` (or an engine's ``connect``)
    from any thread or process. ``close()`` (or leaving ``with``) stops the server, closes
    every connection (clients then see ``StoreError``/``PeerLostError``, as when an
    ``async with StoreServer`` block exits) and ends the thread; it is idempotent and
    thread-safe, and it blocks the calling thread until the server is closed (at most ~5 s:
    the server's own close bound), so an event loop should call it through
    ``anyio.to_thread.run_sync``. A handle never closed keeps serving until the interpreter
    exits (the thread is a daemon); a forked child does not inherit the thread.

    Cancellation: none to speak of; nothing here runs on the caller's event loop.
    """

    def __init__(self, server: StoreServer, *, loop: str = "asyncio") -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()  # a forked child has no such thread: its close() is a no-op
        self._portal_cm = start_blocking_portal(
            "asyncio", backend_options={"use_uvloop": loop == "uvloop"},
            name="m2n-async-store")
        portal = self._portal_cm.__enter__()
        self._thread_ident = portal.call(threading.get_ident)
        try:
            self._server_cm: AbstractContextManager[Any] = (
                portal.wrap_async_context_manager(server))
            self._server: StoreServer = self._server_cm.__enter__()
            self._address: str = self._server.address
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @property
    def address(self) -> str:
        """``"host:port"`` the server listens on."""
        return self._address

    @property
    def server(self) -> StoreServer:
        """The ``StoreServer`` itself (its counters, e.g. ``connections``); call nothing of
        it from another thread but its read-only properties."""
        return self._server

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def close(self) -> None:
        """Stop serving, close every connection and end the thread. Idempotent; refused from
        the store's own thread (it would wait for itself). In a forked child it only marks
        the handle closed: the thread, and the server's sockets, are the parent's."""
        if os.getpid() != self._pid:
            self._closed = True
            return
        if threading.get_ident() == self._thread_ident:
            raise StoreError("StoreThread.close() called on the store's own thread: it "
                             "would wait for itself")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._server_cm.__exit__(None, None, None)
            finally:
                self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<StoreThread {self._address} {state}>"
