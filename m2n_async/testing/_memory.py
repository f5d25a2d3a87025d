"""``MemoryStore``: the in-process test double of the ``Store`` protocol.

Theory of operation: it drives the very same ``StoreCore`` state machine that the TCP server
drives, with anyio events in place of sockets, so tests of code written against ``Store``
(``ControlGroup``, the handshake) exercise the real semantics — waits, ``watch``, tombstones,
stale generations — without a network. Each ``MemoryStore`` handle is one session;
``store.session()`` opens another session on the same data (another "process"), and
``aclose()`` ends a session exactly like a dropped connection (its ephemeral keys vanish and
watchers get ``PeerLostError``). Every call checkpoints, so cancellation behaves as over TCP.
Single event loop only; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

import anyio
from anyio.lowlevel import checkpoint

from m2n_async._proto.errors import StoreError
from m2n_async._store._client import _fresh  # one rule for both stores' raised errors
from m2n_async._store._core import (
    DEFAULT_MAX_BYTES,
    Snapshot,
    StoreCore,
    Waiter,
    check_request_keys,
)
from m2n_async._store._wire import DEFAULT_MAX_FRAME

__all__ = ["MemoryStore"]

_Begin = Callable[[Callable[[], None]], Waiter]


class MemoryStore:
    """An in-memory ``Store`` (one session); ``session()`` opens more on the same data."""

    def __init__(self, *, max_tombstones: int = 65536, max_waiters_per_session: int = 4096,
                 max_bytes: int | None = DEFAULT_MAX_BYTES, max_job_bytes: int | None = None,
                 max_reply: int | None = DEFAULT_MAX_FRAME, _core: StoreCore | None = None
                 ) -> None:
        # The limits default to the TCP server's, so a test that passes here passes over TCP.
        self.core = _core if _core is not None else StoreCore(
            max_tombstones=max_tombstones, max_waiters_per_session=max_waiters_per_session,
            max_bytes=max_bytes, max_job_bytes=max_job_bytes, max_reply=max_reply)
        self._session = self.core.open_session()
        self._pending: dict[anyio.Event, Waiter] = {}  # blocking calls in flight here

    def session(self) -> MemoryStore:
        """Another session (as if another process connected) sharing this store's data."""
        return MemoryStore(_core=self.core)

    @property
    def closed(self) -> bool:
        """Whether this session has ended."""
        return self._session.closed

    async def set(self, key: str, value: bytes, *, ephemeral: bool = False) -> None:
        """Write ``key``. Cancellation: before the write, nothing happened."""
        await checkpoint()
        self._check()
        self.core.set(self._session, key, bytes(value), ephemeral=ephemeral)

    async def get(self, key: str, *, wait: bool = False, watch: Sequence[str] = ()
                  ) -> bytes | None:
        """The value of ``key``; ``wait=True`` blocks until it exists.

        Cancellation: safe at any point; a pending wait is withdrawn.
        """
        await checkpoint()
        self._check()
        if not wait:
            check_request_keys("get", watch)  # refused as StoreClient refuses it: a wire limit
            return self.core.get(self._session, key)
        result = await self._block(lambda notify: self.core.begin_get(
            self._session, key, tuple(watch), notify))
        assert isinstance(result, bytes)
        return result

    async def wait(self, keys: Sequence[str], *, watch: Sequence[str] = ()) -> None:
        """Block until every key has been set. Cancellation: safe; the wait is withdrawn."""
        await checkpoint()
        self._check()
        await self._block(lambda notify: self.core.begin_wait(
            self._session, tuple(keys), tuple(watch), notify))

    async def add(self, key: str, delta: int = 1) -> int:
        """Atomic int64 add. Cancellation: before the add, nothing happened."""
        await checkpoint()
        self._check()
        return self.core.add(self._session, key, delta)

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes
                          ) -> tuple[bool, bytes | None]:
        """Compare-and-set. Cancellation: before the swap, nothing happened."""
        await checkpoint()
        self._check()
        return self.core.compare_set(self._session, key, expected, bytes(desired))

    async def delete(self, key: str, *, lost: bool = False) -> bool:
        """Remove ``key`` (``lost``: as ``Store.delete``). Cancellation: before the delete,
        nothing happened."""
        await checkpoint()
        self._check()
        return self.core.delete(self._session, key, lost=lost)

    async def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``. Cancellation: before it, nothing happened."""
        await checkpoint()
        self._check()
        return self.core.delete_prefix(self._session, prefix)

    async def gather(self, prefix: str, n: int, *, watch: Sequence[str] = ()
                     ) -> dict[str, bytes]:
        """Block until ``n`` keys exist under ``prefix``; all of them.

        Cancellation: safe at any point; the wait is withdrawn.
        """
        await checkpoint()
        self._check()
        result = await self._block(lambda notify: self.core.begin_gather(
            self._session, prefix, n, tuple(watch), notify))
        assert isinstance(result, Snapshot)
        return dict(result.items)  # a copy: the snapshot is shared with other sessions

    async def exchange(self, key: str, value: bytes, prefix: str, n: int, *,
                       watch: Sequence[str] = (), delete: str | None = None
                       ) -> dict[str, bytes]:
        """Atomically delete ``delete``, set ``key``, then ``gather(prefix, n)``.

        Cancellation: if cancelled while waiting, the set (and delete) happened; the gather is
        withdrawn.
        """
        await checkpoint()
        self._check()
        result = await self._block(lambda notify: self.core.begin_exchange(
            self._session, key, bytes(value), delete, prefix, n, tuple(watch), notify))
        assert isinstance(result, Snapshot)
        return dict(result.items)  # a copy: the snapshot is shared with other sessions

    async def aclose(self) -> None:
        """End this session: its ephemeral keys vanish, and its own blocking calls still in
        flight fail with ``StoreError`` (as the TCP client's do). Cancellation: completes at
        once."""
        # The core forgets a closed session's waiters; the calls still waiting on them must
        # fail rather than return nothing.
        open_calls = [(e, w) for e, w in self._pending.items() if not w.done]
        self.core.close_session(self._session)
        for event, waiter in open_calls:
            waiter.error = StoreError(f"memory store session {self._session.id} was closed")
            event.set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def _check(self) -> None:
        if self._session.closed:
            raise StoreError(f"memory store session {self._session.id} is closed")

    async def _block(self, begin: _Begin) -> bytes | Snapshot | None:
        event = anyio.Event()
        waiter = begin(event.set)
        if not waiter.done:
            self._pending[event] = waiter
            try:
                await event.wait()
            finally:
                del self._pending[event]
                self.core.cancel(waiter)  # no-op once done; withdraws it if we were cancelled
        if waiter.error is not None:
            raise _fresh(waiter.error)
        return waiter.result
