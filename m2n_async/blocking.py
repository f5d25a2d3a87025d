"""Blocking facade: the async engines for synchronous callers (vLLM workers, Ray actors, scripts).

Theory of operation: ``TrainerEngine`` and ``WorkerEngine`` are anyio coroutines, but many of
their callers are plain threads — vLLM calls its weight-transfer backend synchronously inside
``collective_rpc``, a Ray actor method is a function, a training script is a loop. Each
blocking engine owns one event loop on its own thread, started by anyio's blocking portal
(``anyio.from_thread.start_blocking_portal``), and lives there from ``connect`` to ``close``:
the store connection, the round watchdogs and the data plane's completion wakeups keep running
between calls, exactly as they would under ``anyio.run``. A blocking method submits the
coroutine to that loop and waits for its result in the calling thread; its exceptions are the
async API's, re-raised unchanged.

Timeouts and cancellation are the async API's, carried over:

- ``timeout=`` means what it means on the coroutine (the round deadline for
  ``sync_weights``, the wait for a round to start for ``receive``, the whole handshake for
  ``connect``).
- A blocking call has no cancel scope; what interrupts it is an exception raised in the
  waiting thread (``KeyboardInterrupt`` from Ctrl-C, or an async exception a framework
  injects). The facade then cancels the coroutine on the loop and **waits for it to finish**
  before re-raising, so the engine has applied its documented cancellation semantics (e.g.
  a round cancelled mid-way has posted its abort record and the engine is POISONED) by the
  time the caller sees the exception. A second interrupt while waiting stops that wait.
- ``progress`` callbacks run on the engine's loop thread, not the caller's.

``close()`` closes the engine (shielded and bounded, as ``close`` is) and then stops the loop
thread; it is idempotent and is also what leaving a ``with`` block does. One call at a time
per engine, as for the async engines (a second concurrent ``sync_weights``/``receive`` raises
``LocalProtocolError``); read-only properties may be read from any thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from m2n_async._engine._config import EngineConfig, EngineState, SyncResult
from m2n_async._engine._engine import TrainerEngine, WorkerEngine, _Engine
from m2n_async._proto.errors import LocalProtocolError

if TYPE_CHECKING:
    from m2n_async._engine._sources import Weights
    from m2n_async._proto.params import ParamSpec
    from m2n_async._proto.plan import TransferPlan
    from m2n_async._store import Store

__all__ = ["BlockingTrainer", "BlockingWorker"]

T = TypeVar("T")
E = TypeVar("E", bound="_Engine")
Progress = Callable[[int, int], None]


class _Loop:
    """One anyio event loop on its own thread (a blocking portal) and a way to call into it."""

    def __init__(self, name: str) -> None:
        self._cm = start_blocking_portal("asyncio", name=name)
        self.portal: BlockingPortal = self._cm.__enter__()
        self._closed = False

    def call(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop; block until it finished.

        An exception raised in this thread while waiting cancels the task, waits until it has
        finished (its cancellation handling done), then propagates.
        """
        if self._closed:
            raise LocalProtocolError("this blocking engine is closed (its event loop thread "
                                     "has stopped); connect again")
        finished = threading.Event()

        async def run() -> T:
            try:
                return await fn(*args, **kwargs)
            finally:
                finished.set()  # the task is over, whichever way it ended

        future = self.portal.start_task_soon(run)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            # Cancelled from inside the loop (the portal stopping): the engine's state says
            # what happened; report it as an interruption, not as a silent None.
            raise LocalProtocolError("the call was cancelled on the engine's event loop "
                                     "(the blocking engine is being closed)") from None
        except BaseException:
            if not future.done():
                future.cancel()  # cancels the task's scope on the loop
                finished.wait()  # its cancellation semantics applied before we re-raise
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cm.__exit__(None, None, None)  # stops the portal and joins its thread


class _Blocking(Generic[E]):
    """What both blocking roles share: the loop, the engine, close and the read-only facts."""

    def __init__(self, loop: _Loop, engine: E) -> None:
        self._loop = loop
        self._engine: E = engine
        self._closing = threading.Lock()

    @property
    def engine(self) -> E:
        """The async engine underneath (its coroutines must run on ``portal``'s loop)."""
        return self._engine

    @property
    def portal(self) -> BlockingPortal:
        """The blocking portal of the engine's loop, to run other coroutines beside it."""
        return self._loop.portal

    @property
    def state(self) -> EngineState:
        """The engine's lifecycle state (PREFLIGHT, READY, UPDATING, POISONED, CLOSED)."""
        return self._engine.state

    @property
    def version(self) -> int:
        """The last version committed on every rank (0 before the first round)."""
        return self._engine.version

    @property
    def generation(self) -> int:
        """The store generation this engine joined."""
        return self._engine.generation

    @property
    def rank(self) -> int:
        """This engine's rank in the job (trainers ``[0, T)``, workers ``[T, T + N)``)."""
        return self._engine.rank

    @property
    def plan(self) -> TransferPlan:
        """The plan every rank agreed on."""
        return self._engine.plan

    @property
    def transport(self) -> str:
        """The agreed transport name."""
        return self._engine.transport

    def close(self) -> None:
        """Close the engine (as ``close()`` on the async engine: from any state, shielded,
        bounded by ``abort_grace`` per step), then stop its event loop thread. Idempotent;
        safe to call from any thread except the engine's own loop thread.
        """
        with self._closing:
            if self._loop._closed:
                return
            try:
                self._loop.call(self._engine.close)
            finally:
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._engine!r}>"


def _connect(connect: Callable[..., Awaitable[E]], name: str, /, **kwargs: Any
             ) -> tuple[_Loop, E]:
    loop = _Loop(name)
    try:
        engine = loop.call(functools.partial(connect, **kwargs))
    except BaseException:
        loop.close()  # connect released what it created; the loop goes with it
        raise
    return loop, engine


class BlockingTrainer(_Blocking[TrainerEngine]):
    """A ``TrainerEngine`` for synchronous callers, on an event loop thread of its own."""

    @classmethod
    def connect(cls, address: str | tuple[str, int] | None = None, *,
                token: str | bytes | None = None, rank: int, trainer_ranks: int,
                world_size: int, params: Sequence[ParamSpec],
                config: EngineConfig | None = None, store: Store | None = None,
                timeout: float | None = None) -> BlockingTrainer:
        """``TrainerEngine.connect`` on a new event loop thread; blocks until READY.

        Arguments, errors and timeout as ``TrainerEngine.connect``. A ``store`` passed in must
        be usable from the new loop (open it there through ``portal``, or pass ``address``).
        Interrupted (``KeyboardInterrupt``): the connect is cancelled and has released what it
        created (peers fail their handshake), the loop thread is stopped, and the interrupt
        propagates.
        """
        loop, engine = _connect(TrainerEngine.connect, f"m2n-async-trainer{rank}", address=address,
                                token=token, rank=rank, trainer_ranks=trainer_ranks,
                                world_size=world_size, params=params, config=config,
                                store=store, timeout=timeout)
        return cls(loop, engine)

    def sync_weights(self, weights: Weights, *, version: int | None = None,
                     timeout: float | None = None,
                     progress: Progress | None = None) -> SyncResult:
        """``TrainerEngine.sync_weights``, blocking: one round; returns once every rank
        reported success.

        Arguments, results and errors as the coroutine (``timeout``, on rank 0, is the round
        deadline of every rank). ``weights`` is read on the engine's loop thread (and a
        callable source is called there) while this thread waits; keep the tensors unchanged
        until this returns. Interrupted: as the coroutine cancelled — before rank 0 published
        the round nothing happened (READY); during the round this rank aborts it everywhere
        and is POISONED; the interrupt propagates once that is done.
        """
        return self._loop.call(self._engine.sync_weights, weights, version=version,
                               timeout=timeout, progress=progress)


class BlockingWorker(_Blocking[WorkerEngine]):
    """A ``WorkerEngine`` for synchronous callers, on an event loop thread of its own."""

    @classmethod
    def connect(cls, address: str | tuple[str, int] | None = None, *,
                token: str | bytes | None = None, rank: int, trainer_ranks: int,
                world_size: int, targets: Mapping[str, Any],
                mesh_dims: tuple[int, int] | None = None, config: EngineConfig | None = None,
                store: Store | None = None, timeout: float | None = None) -> BlockingWorker:
        """``WorkerEngine.connect`` on a new event loop thread; blocks until READY.

        Arguments, errors and timeout as ``WorkerEngine.connect``; interruption as
        ``BlockingTrainer.connect``. Load callbacks (``LoadTarget.load``) run where the
        async engine runs them (the transport's unpack thread), never on the caller's thread.
        """
        loop, engine = _connect(WorkerEngine.connect, f"m2n-async-worker{rank}", address=address,
                                token=token, rank=rank, trainer_ranks=trainer_ranks,
                                world_size=world_size, targets=targets, mesh_dims=mesh_dims,
                                config=config, store=store, timeout=timeout)
        return cls(loop, engine)

    def receive(self, *, timeout: float | None = None,
                progress: Progress | None = None) -> SyncResult:
        """``WorkerEngine.receive``, blocking: wait for the next round and write it into the
        targets; returns once every rank reported success.

        ``timeout`` bounds the wait for the round to start (``TimeoutError``, the engine
        stays READY), as on the coroutine. Errors as the coroutine. Interrupted: while
        waiting for the start nothing happened (READY); during the round this rank aborts it
        everywhere and is POISONED (targets may be partly written); the interrupt propagates
        once that is done.
        """
        return self._loop.call(self._engine.receive, timeout=timeout, progress=progress)

    def updates(self) -> Iterator[SyncResult]:
        """``for result in worker.updates():`` — one ``SyncResult`` per round, until trainer
        rank 0 closes the job (the iteration then ends). Errors and interruption as
        ``receive``; the iterator must be used from one thread.
        """
        agen: AsyncIterator[SyncResult] = self._engine.updates()
        try:
            while True:
                try:
                    yield self._loop.call(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop._closed:
                with contextlib.suppress(Exception):
                    self._loop.call(agen.aclose)  # type: ignore[attr-defined]
