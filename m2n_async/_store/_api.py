"""The ``Store`` protocol: what the control plane needs from a key-value store.

Theory of operation: ``StoreClient`` (TCP) and ``m2n_async.testing.MemoryStore`` (in-process)
both implement this structural protocol, and one conformance suite (``tests/store``) runs
against both, so code written against ``Store`` — ``ControlGroup``, the handshake, the engine —
can be tested without sockets and run over TCP unchanged.

Semantics shared by every implementation:

- Values are opaque ``bytes``; ``add`` stores its counter as ASCII decimal (``get`` reads it).
- Blocking calls (``get(wait=True)``, ``wait``, ``gather``) take no timeout: the caller's
  cancel scope bounds them, and cancelling one leaves the store usable.
- ``watch``: keys written ``ephemeral=True`` by other sessions (liveness keys). If a watched
  key is lost because its session ended — before or during the wait — the call raises
  ``PeerLostError(key=...)`` at once. A watched key that never existed does not fail the wait.
  A call whose condition already holds returns its data even if a watched key is lost.
- Keys under ``{job}/{generation}/`` of a generation older than the job's current one (see
  ``next_generation``) are refused with ``StaleGenerationError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Store", "SupportsExchange"]


@runtime_checkable
class Store(Protocol):
    """A key-value store with blocking waits, atomic counters and liveness."""

    async def set(self, key: str, value: bytes, *, ephemeral: bool = False) -> None:
        """Write ``key``; ``ephemeral`` keys vanish when this session ends."""
        ...

    async def get(self, key: str, *, wait: bool = False, watch: Sequence[str] = ()
                  ) -> bytes | None:
        """The value of ``key`` (``None`` if absent); ``wait=True`` blocks until it exists."""
        ...

    async def wait(self, keys: Sequence[str], *, watch: Sequence[str] = ()) -> None:
        """Block until every key of ``keys`` has been set."""
        ...

    async def add(self, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the int64 counter at ``key`` (absent = 0); new value."""
        ...

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes
                          ) -> tuple[bool, bytes | None]:
        """Set ``key`` to ``desired`` iff it holds ``expected`` (``None``: absent).

        Returns ``(swapped, current)``: current is the value after the call.
        """
        ...

    async def delete(self, key: str, *, lost: bool = False) -> bool:
        """Remove ``key``; whether it existed. ``lost=True`` removes it as its session's end
        would: watchers of ``key`` get ``PeerLostError`` (a plain delete is a clean leave)."""
        ...

    async def delete_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix``; how many."""
        ...

    async def gather(self, prefix: str, n: int, *, watch: Sequence[str] = ()
                     ) -> dict[str, bytes]:
        """Block until at least ``n`` keys exist under ``prefix``; return them all."""
        ...

    async def aclose(self) -> None:
        """End this session (its ephemeral keys vanish). Idempotent."""
        ...


@runtime_checkable
class SupportsExchange(Protocol):
    """Optional extension: a store that can set, delete and gather in one atomic step.

    ``ControlGroup`` uses it when present (one round trip per collective instead of three);
    ``StoreClient`` and ``MemoryStore`` both provide it.
    """

    async def exchange(self, key: str, value: bytes, prefix: str, n: int, *,
                       watch: Sequence[str] = (), delete: str | None = None
                       ) -> dict[str, bytes]:
        """Delete ``delete`` (if given), set ``key``, then ``gather(prefix, n, watch)``."""
        ...
