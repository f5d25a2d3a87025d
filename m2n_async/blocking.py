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
- ``progress`` callbacks run on the engine's loop thread, not the caller's. One that raises
  ``KeyboardInterrupt`` or ``SystemExit`` fails the round as any error of its callback does
  (every rank raises at once, naming this rank; this engine is POISONED), and the call
  raises that exception in the caller's thread; the loop thread keeps running, so
  ``close()`` still releases the engine.

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

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from m2n_async._engine._config import EngineConfig, EngineState, SyncResult
from m2n_async._engine._engine import TrainerEngine, WorkerEngine, _clean_exit, _Engine
from m2n_async._proto.errors import LocalProtocolError

if TYPE_CHECKING:
    from m2n_async._engine._sources import Weights
    from m2n_async._proto.params import ParamSpec
    from m2n_async._proto.plan import TransferPlan
    from m2n_async._store import Store

__all__ = ["BlockingTrainer", "BlockingWorker", "Pending"]

T = TypeVar("T")
E = TypeVar("E", bound="_Engine")
B = TypeVar("B", bound="_Blocking[Any]")
Progress = Callable[[int, int], None]


class Pending(Generic[T]):
    """A call started on a blocking engine's event loop and not waited for yet.

    What ``start_connect``/``start_sync_weights``/``start_receive`` return, for callers that
    must do something else while the call runs (a trainer that sends vLLM's update RPC while
    its round is in flight). ``result()`` waits as the blocking method would; ``cancel()``
    cancels the coroutine on the loop and returns once it has finished, its cancellation
    semantics applied (those of the async method).
    """

    def __init__(self, future: concurrent.futures.Future[T], finished: threading.Event,
                 interrupt: list[BaseException] | None = None) -> None:
        self._future = future
        self._finished = finished
        #: what the call raised that is no ``Exception`` (``KeyboardInterrupt``,
        #: ``SystemExit``): kept off the loop (``_Loop.submit``), raised by ``result()``
        self._interrupt: list[BaseException] = [] if interrupt is None else interrupt
        self._cancelled = False  # cancel() was called

    @property
    def future(self) -> concurrent.futures.Future[T]:
        """The underlying future, e.g. for ``concurrent.futures.wait`` (do not cancel it
        directly: ``cancel()`` also waits for the coroutine to finish)."""
        return self._future

    def done(self) -> bool:
        """True once the coroutine has finished, whichever way."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the call and return its result or raise its exception.

        ``timeout``: seconds to wait here; on expiry ``TimeoutError`` is raised and the call
        keeps running (wait again or ``cancel()``). An exception raised in this thread while
        waiting (``KeyboardInterrupt``) cancels the call, waits until it finished, then
        propagates.
        """
        try:
            got = self._future.result(timeout)
        except concurrent.futures.CancelledError:
            if self._cancelled:
                raise LocalProtocolError("the call was cancelled by its Pending.cancel(); "
                                         "the engine's state says what that did") from None
            # Cancelled from inside the loop (the portal stopping): the engine's state says
            # what happened; report it as an interruption, not as a silent None.
            raise LocalProtocolError("the call was cancelled on the engine's event loop "
                                     "(the blocking engine is being closed)") from None
        except TimeoutError:
            raise  # ours (the call goes on) or the coroutine's own (it has finished)
        except BaseException:
            self.cancel()
            raise
        if self._interrupt:
            raise self._interrupt[0]
        return got

    def cancel(self) -> None:
        """Cancel the call (as cancelling the coroutine) and wait until it has finished.
        A ``result()`` after it raises ``LocalProtocolError`` saying so, unless the call had
        already finished (its result or its exception, then)."""
        self._cancelled = True
        if not self._future.done():
            self._future.cancel()  # cancels the task's scope on the loop
        self._finished.wait()  # its cancellation semantics applied before we return


class _Loop:
    """One anyio event loop on its own thread (a blocking portal) and a way to call into it."""

    def __init__(self, name: str) -> None:
        self._cm = start_blocking_portal("asyncio", name=name)
        self.portal: BlockingPortal = self._cm.__enter__()
        self.closed = False
        #: the loop thread's ident: ``close`` cannot run there (it joins that thread)
        self.thread_id: int = self.portal.call(threading.get_ident)

    def submit(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any
               ) -> Pending[T]:
        """Start ``fn(*args, **kwargs)`` on the loop."""
        if self.closed:
            raise LocalProtocolError("this blocking engine is closed (its event loop thread "
                                     "has stopped); connect again")
        finished = threading.Event()
        interrupt: list[BaseException] = []

        async def run() -> T:
            try:
                return await fn(*args, **kwargs)
            except Exception:
                raise
            except BaseException as exc:
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise
                # KeyboardInterrupt, SystemExit (a callback's, which the engine raises once
                # its round failed): raised in a task, asyncio would stop this loop with
                # it, and the engine could never be closed. The caller's thread gets it.
                interrupt.append(exc)
                return None  # type: ignore[return-value]  # result() raises it instead
            finally:
                finished.set()  # the task is over, whichever way it ended

        return Pending(self.portal.start_task_soon(run), finished, interrupt)

    def call(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop; block until it finished."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self.refuse_on_loop("close()")
        if self.closed:
            return
        self.closed = True
        self._cm.__exit__(None, None, None)  # stops the portal and joins its thread

    def refuse_on_loop(self, what: str) -> None:
        """``LocalProtocolError`` when called on the loop thread itself (a progress callback
        runs there): blocking on the loop from the loop would wait for itself."""
        if threading.get_ident() == self.thread_id:
            raise LocalProtocolError(f"{what} cannot be called on the engine's own event "
                                     f"loop thread (e.g. from a progress callback); call it "
                                     f"from another thread")


class _PendingConnect(Pending[B]):
    """A connect in progress: its result is the blocking engine; a failure stops the loop."""

    def __init__(self, loop: _Loop, wrap: Callable[[_Loop, Any], B],
                 inner: Pending[Any]) -> None:
        super().__init__(inner.future, inner._finished, inner._interrupt)
        self._loop = loop
        self._wrap = wrap

    def result(self, timeout: float | None = None) -> B:
        try:
            engine = super().result(timeout)
        except TimeoutError:
            if not self.done():
                raise  # still connecting
            self._loop.close()
            raise
        except BaseException:
            self._loop.close()  # connect released what it created; the loop goes with it
            raise
        return self._wrap(self._loop, engine)

    def cancel(self) -> None:
        super().cancel()
        if not self._future.done() or self._future.cancelled() or self._interrupt or \
                self._future.exception() is not None:
            self._loop.close()
        else:  # it connected before the cancel landed: close what it opened
            engine: Any = self._future.result()  # the async engine, not yet wrapped
            with contextlib.suppress(Exception):
                self._loop.call(engine.close)
            self._loop.close()


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
        """The engine's lifecycle state (PREFLIGHT, READY, UPDATING, POISONED, CLOSED;
        ``EngineState`` says what each means: POISONED on a worker whose job ended too)."""
        return self._engine.state

    @property
    def version(self) -> int:
        """The last version committed on every rank (0 before the first round of this
        engine: the count restarts with every connect)."""
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

    def close(self, *, error: BaseException | str | None = None) -> None:
        """Close the engine (as ``close()`` on the async engine: from any state, shielded,
        bounded by ``abort_grace`` per step; ``error`` as there), then stop its event loop
        thread. Idempotent; safe to call from any thread but the engine's own loop thread (a
        progress callback runs there), where it raises ``LocalProtocolError`` and changes
        nothing. A ``receive()`` blocked in another thread waiting for a round raises
        ``LocalProtocolError``.
        """
        # Refused before anything changes, so that a later close() from a proper thread
        # still closes the engine and stops the loop.
        self._loop.refuse_on_loop("close()")
        with self._closing:
            if self._loop.closed:
                return
            try:
                self._loop.call(functools.partial(self._engine.close, error=error))
            finally:
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        # An exception leaving the block is no clean end of the job: the peers are told.
        self.close(error=None if _clean_exit(exc) else exc)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._engine!r}>"


def _start_connect(cls: type[B], connect: Callable[..., Awaitable[Any]], name: str, /,
                   **kwargs: Any) -> _PendingConnect[B]:
    loop = _Loop(name)
    try:
        inner = loop.submit(functools.partial(connect, **kwargs))
    except BaseException:
        loop.close()
        raise
    return _PendingConnect(loop, cls, inner)


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
        return cls.start_connect(address, token=token, rank=rank, trainer_ranks=trainer_ranks,
                                 world_size=world_size, params=params, config=config,
                                 store=store, timeout=timeout).result()

    @classmethod
    def start_connect(cls, address: str | tuple[str, int] | None = None, *,
                      token: str | bytes | None = None, rank: int, trainer_ranks: int,
                      world_size: int, params: Sequence[ParamSpec],
                      config: EngineConfig | None = None, store: Store | None = None,
                      timeout: float | None = None) -> Pending[BlockingTrainer]:
        """``connect`` without waiting: ``.result()`` is the READY ``BlockingTrainer``;
        ``.cancel()`` cancels the connect (as cancelling the coroutine) and stops the loop."""
        return _start_connect(cls, TrainerEngine.connect, f"m2n-async-trainer{rank}",
                              address=address, token=token, rank=rank,
                              trainer_ranks=trainer_ranks, world_size=world_size,
                              params=params, config=config, store=store, timeout=timeout)

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
        return self.start_sync_weights(weights, version=version, timeout=timeout,
                                       progress=progress).result()

    def start_sync_weights(self, weights: Weights, *, version: int | None = None,
                           timeout: float | None = None,
                           progress: Progress | None = None) -> Pending[SyncResult]:
        """``sync_weights`` without waiting (e.g. to send an RPC that makes the workers
        receive while the round runs): ``.result()`` as ``sync_weights``; ``.cancel()`` as
        cancelling the coroutine (during the round: aborted everywhere, POISONED)."""
        return self._loop.submit(self._engine.sync_weights, weights, version=version,
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
        return cls.start_connect(address, token=token, rank=rank, trainer_ranks=trainer_ranks,
                                 world_size=world_size, targets=targets, mesh_dims=mesh_dims,
                                 config=config, store=store, timeout=timeout).result()

    @classmethod
    def start_connect(cls, address: str | tuple[str, int] | None = None, *,
                      token: str | bytes | None = None, rank: int, trainer_ranks: int,
                      world_size: int, targets: Mapping[str, Any],
                      mesh_dims: tuple[int, int] | None = None,
                      config: EngineConfig | None = None, store: Store | None = None,
                      timeout: float | None = None) -> Pending[BlockingWorker]:
        """``connect`` without waiting, as ``BlockingTrainer.start_connect``."""
        return _start_connect(cls, WorkerEngine.connect, f"m2n-async-worker{rank}",
                              address=address, token=token, rank=rank,
                              trainer_ranks=trainer_ranks, world_size=world_size,
                              targets=targets, mesh_dims=mesh_dims, config=config,
                              store=store, timeout=timeout)

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
        return self.start_receive(timeout=timeout, progress=progress).result()

    def start_receive(self, *, timeout: float | None = None,
                      progress: Progress | None = None) -> Pending[SyncResult]:
        """``receive`` without waiting (e.g. to consume load callbacks on this thread while
        the round runs): ``.result()`` as ``receive``; ``.cancel()`` as cancelling it."""
        return self._loop.submit(self._engine.receive, timeout=timeout, progress=progress)

    def updates(self) -> Iterator[SyncResult]:
        """``for result in worker.updates():`` — one ``SyncResult`` per round, until trainer
        rank 0 closes the job or opens a newer generation (the iteration then ends and the
        engine is POISONED: a later ``updates()`` ends at once; close it and connect again),
        or this engine is closed; rank 0 closing on an error raises its ``PeerLostError``.
        Errors and interruption as ``receive``; the iterator must be used from one thread.
        """
        agen: AsyncIterator[SyncResult] = self._engine.updates()
        try:
            while True:
                try:
                    yield self._loop.call(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.closed:
                with contextlib.suppress(Exception):
                    self._loop.call(agen.aclose)  # type: ignore[attr-defined]
