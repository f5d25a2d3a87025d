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
  ``close()`` still releases the engine. Waiting there — ``close()``, another call of the
  engine, a ``Pending``'s ``result()`` or ``cancel()`` — would wait for the loop itself: each
  is refused with ``LocalProtocolError``. Waiting in a thread that runs an asyncio event
  loop (an ``async def`` calling the facade) blocks that loop for the call: it works, with a
  ``RuntimeWarning`` at the caller's line, unless the loop serves something the call needs
  (a ``StoreServer``: the call then times out). Use the async engines there.

``close()`` closes the engine (shielded and bounded, as ``close`` is) and then stops the loop
thread; it is idempotent and is also what leaving a ``with`` block does. One call at a time
per engine, as for the async engines (a second concurrent ``sync_weights``/``receive`` raises
``LocalProtocolError``); read-only properties may be read from any thread.

A blocking engine that is never closed is not left running: when it is garbage-collected (or
a ``start_connect`` is dropped without ``result()``/``cancel()``) a ``ResourceWarning`` names
it and the engine is closed on the error ``"<it> was never closed"`` (trainer rank 0's workers
raise ``PeerLostError`` naming it, as for any close on an error), then its loop thread is
stopped. The collector only queues that work: one reaper thread of this module does it, so a
collection never blocks, whichever thread it runs in (the loop thread included). Engines still
open at interpreter exit are closed the same way by an ``atexit`` hook, which waits for those
closes at most ``2 * abort_grace`` seconds before letting the process exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import os
import queue
import sys
import threading
import time
import types
import warnings
import weakref
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


# -- what is never closed ------------------------------------------------------------------
#
# A finalizer may run inside any thread, at any allocation or bytecode, while that thread
# holds any lock (``threading``'s own among them): it must neither block nor take a lock. So
# it only puts the work on a ``SimpleQueue`` (whose ``put`` is safe there, by design) and
# warns; a reaper thread, started before any finalizer can run, starts one closer per item.

#: a close to run (its callable, its error text, the seconds it may take at exit), or an
#: event to set once the closes queued before it have their closers started
_Reap = tuple[Callable[[str], None], str, float] | threading.Event
_reap_queue: queue.SimpleQueue[_Reap] = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None
#: closers running, each with the seconds it may take at interpreter exit
_closers: dict[threading.Thread, float] = {}
#: facades and connects whose finalizer has not run: what ``_close_at_exit`` closes
_unclosed: weakref.WeakSet[Any] = weakref.WeakSet()


def _watch(owner: object, label: str, reap: Callable[[str], None],
           grace: float) -> weakref.finalize[Any, Any]:
    """Have ``reap`` run (off the collecting thread) once ``owner`` is collected unclosed.

    ``reap`` must not refer to ``owner`` (it would never be collected); it gets the error
    text to close the engine with. ``grace``: what the close may take at interpreter exit.
    The caller ``detach()``es the finalizer once it has closed what ``reap`` would close."""
    _start_reaper()
    # atexit=False: ``_close_at_exit`` closes what is still open itself, and waits for it
    # (weakref's own exit hook would only queue the closes and let the process end on them).
    finalizer = weakref.finalize(owner, _collected, label, reap, grace, _reap_queue.put)
    finalizer.atexit = False
    _unclosed.add(owner)
    return finalizer


def _start_reaper() -> None:
    """Start the reaper thread (and register the exit hook) unless it runs already."""
    global _reaper
    with _reaper_lock:
        if _reaper is None or not _reaper.is_alive():  # not alive: in a child after fork
            if _reaper is None:
                atexit.register(_close_at_exit)
            _reaper = threading.Thread(target=_reap_forever, name="m2n-async-reaper",
                                       daemon=True)
            _reaper.start()


def _forget_parent() -> None:
    """In a forked child: the parent's loop threads, reaper and closers are not here."""
    global _reaper_lock, _reap_queue
    _reaper_lock = threading.Lock()  # a thread that held it at the fork never releases it here
    _reap_queue = queue.SimpleQueue()  # the closes queued there are the parent's to run
    _closers.clear()
    for owner in list(_unclosed):
        finalizer = getattr(owner, "_finalizer", None)  # None: forked inside _watch
        if finalizer is not None:
            finalizer.detach()  # the parent's engine: closing it here would wait forever
        owner._loop.closed = True  # its thread is the parent's: calls refuse, closes return
    _unclosed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent)


def _collected(label: str, reap: Callable[[str], None], grace: float,
               put: Callable[[_Reap], None], when: str = "garbage-collected") -> None:
    """A finalizer: queue the close of what ``label`` left open, and warn.

    ``put`` is bound at creation: late in interpreter shutdown module globals may be gone."""
    put((reap, f"{label} was never closed ({when})", grace))  # first: a warning may raise
    warnings.warn(f"{label} was never closed; closing it now ({when}): call close() or use "
                  f"a with block", ResourceWarning,
                  stacklevel=1)  # a collector calls this: no caller of the user's to point at


def _reap_forever() -> None:
    while True:
        item = _reap_queue.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        reap, why, grace = item
        closer = threading.Thread(target=_run_closer, args=(reap, why),
                                  name="m2n-async-closer", daemon=True)
        with _reaper_lock:
            _closers[closer] = grace
        closer.start()  # here, not in the finalizer: starting a thread takes threading's locks


def _run_closer(reap: Callable[[str], None], why: str) -> None:
    try:
        reap(why)  # an error propagates to threading.excepthook: a failed close is seen
    finally:
        with _reaper_lock:
            _closers.pop(threading.current_thread(), None)


def _close_at_exit() -> None:
    """``atexit``: close what is still open and wait for every close, a bounded time."""
    failed: Exception | None = None
    for owner in list(_unclosed):
        got = owner._finalizer.detach()
        if got is not None:  # None: closed by its owner meanwhile
            label, reap, grace, put = got[2]
            try:
                _collected(label, reap, grace, put, when="still open at interpreter exit")
            except Exception as exc:  # the warning, with warnings as errors: close the rest
                failed = failed or exc
    flushed = threading.Event()
    _reap_queue.put(flushed)
    with _reaper_lock:
        reaper = _reaper
    if reaper is not None and reaper.is_alive():
        flushed.wait(10.0)  # the reaper only starts threads, so this is quick; bounded anyway
    with _reaper_lock:
        closers = dict(_closers)
    # Bounded: a close that cannot finish (a store that does not answer) must not keep the
    # process from exiting; the closers and loop threads are daemons and end with it.
    deadline = time.monotonic() + max(closers.values(), default=0.0)
    for closer in closers:
        closer.join(max(0.0, deadline - time.monotonic()))
    if failed is not None:
        raise failed  # atexit prints it


def _warn_if_in_a_loop() -> None:
    """``RuntimeWarning`` when the calling thread runs an asyncio event loop: waiting here
    blocks that loop until the call returns, and a ``StoreServer`` it serves cannot answer
    meanwhile (the call then times out blaming the store)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    level = 1
    frame: types.FrameType | None = sys._getframe()
    while frame is not None and frame.f_globals.get("__name__", "").startswith("m2n_async"):
        level, frame = level + 1, frame.f_back  # shown at the caller's line, not ours
    warnings.warn("m2n_async: a blocking call waits inside a running asyncio event loop, "
                  "which it blocks until it returns (a store that loop serves cannot answer "
                  "meanwhile): use TrainerEngine/WorkerEngine there, or run the blocking call "
                  "in a thread (anyio.to_thread.run_sync)", RuntimeWarning, stacklevel=level)


class Pending(Generic[T]):
    """A call started on a blocking engine's event loop and not waited for yet.

    What ``start_connect``/``start_sync_weights``/``start_receive`` return, for callers that
    must do something else while the call runs (a trainer that sends vLLM's update RPC while
    its round is in flight). ``result()`` waits as the blocking method would; ``cancel()``
    cancels the coroutine on the loop and returns once it has finished, its cancellation
    semantics applied (those of the async method).
    """

    def __init__(self, future: concurrent.futures.Future[T], finished: threading.Event,
                 interrupt: list[BaseException] | None = None,
                 loop: _Loop | None = None) -> None:
        self._future = future
        self._finished = finished
        #: the loop the call runs on: waiting for it there would wait for itself
        self._loop = loop
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
        propagates. Refused (``LocalProtocolError``) on the engine's own loop thread.
        """
        if self._loop is not None:
            self._loop.refuse_on_loop("Pending.result()")
        _warn_if_in_a_loop()
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
        already finished (its result or its exception, then). Refused
        (``LocalProtocolError``) on the engine's own loop thread."""
        if self._loop is not None:
            self._loop.refuse_on_loop("Pending.cancel()")
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
        """Start ``fn(*args, **kwargs)`` on the loop; refused on the loop thread itself (a
        progress callback calling the engine again), where no one could wait for it."""
        self.refuse_on_loop(f"{getattr(fn, '__name__', 'this call')}()")
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

        return Pending(self.portal.start_task_soon(run), finished, interrupt, self)

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
    """A connect in progress: its result is the blocking engine; a failure stops the loop.

    Collected before ``result()`` or ``cancel()`` took it over: the connect is cancelled (or
    the engine it made closed) and the loop stopped, off the collecting thread."""

    _loop: _Loop  # always set: the connect's own loop

    def __init__(self, loop: _Loop, wrap: Callable[[_Loop, Any], B],
                 inner: Pending[Any], label: str, grace: float) -> None:
        super().__init__(inner.future, inner._finished, inner._interrupt, loop)
        self._wrap = wrap
        self._wrapped: B | None = None  # result() again returns the same blocking engine
        self._finalizer = _watch(self, f"connect of {label}", functools.partial(
            _abandon_connect, loop, inner.future, inner._finished, inner._interrupt), grace)

    def result(self, timeout: float | None = None) -> B:
        if self._wrapped is not None:
            return self._wrapped
        try:
            engine = super().result(timeout)
        except TimeoutError as exc:
            future = self._future
            if not future.done():
                raise  # still connecting
            if future.cancelled() or future.exception() is not exc:
                # The wait expired, then the connect finished before this line: its outcome
                # (an engine to wrap, or its error), not a timeout with the loop closed
                # under the engine it made.
                return self.result(0)
            self._finalizer.detach()  # the connect's own TimeoutError (PhaseTimeoutError)
            self._loop.close()
            raise
        except BaseException:
            self._finalizer.detach()
            self._loop.close()  # connect released what it created; the loop goes with it
            raise
        try:
            self._wrapped = self._wrap(self._loop, engine)
        except BaseException:
            self._finalizer.detach()
            _release_connect(self._loop, self._future, self._interrupt)  # nobody else could
            raise
        self._finalizer.detach()  # after: the blocking engine watches the loop from now on
        return self._wrapped

    def cancel(self) -> None:
        if self._wrapped is not None:  # connected and handed out: cancelling closes it
            self._wrapped.close()
            return
        self._finalizer.detach()
        super().cancel()
        _release_connect(self._loop, self._future, self._interrupt)


def _release_connect(loop: _Loop, future: concurrent.futures.Future[Any],
                     interrupt: list[BaseException], error: str | None = None) -> None:
    """Stop the loop of a finished connect, closing first the engine it made, if it did."""
    if future.done() and not future.cancelled() and not interrupt and \
            future.exception() is None:  # it connected before the cancel landed
        engine: Any = future.result()  # the async engine, not yet wrapped
        with contextlib.suppress(Exception):
            loop.call(functools.partial(engine.close, error=error))
    loop.close()


def _abandon_connect(loop: _Loop, future: concurrent.futures.Future[Any],
                     finished: threading.Event, interrupt: list[BaseException],
                     why: str) -> None:
    """What ``cancel()`` does, for a connect collected before anyone waited for it."""
    if not future.done():
        future.cancel()  # cancels the connect on the loop: it releases what it made
    finished.wait()
    _release_connect(loop, future, interrupt, why)


class _Blocking(Generic[E]):
    """What both blocking roles share: the loop, the engine, close and the read-only facts."""

    def __init__(self, loop: _Loop, engine: E) -> None:
        self._loop = loop
        self._engine: E = engine
        self._closing = threading.Lock()
        label = (f"{type(self).__name__} for rank {engine.rank} (job {engine.config.job!r}, "
                 f"generation {engine.generation})")
        # The reap holds the loop and the engine, never self: self stays collectable.
        self._finalizer = _watch(self, label, functools.partial(_close_abandoned, loop, engine),
                                 2 * engine.config.abort_grace)

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
    def last_began(self) -> int:
        """The last round this rank's part of began (``WorkerEngine.last_began``): a call
        that failed with a ``TransferError`` of a later ``round`` wrote nothing here."""
        return self._engine.last_began

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
            self._finalizer.detach()  # closed by its owner: nothing left to do when collected
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


def _close_abandoned(loop: _Loop, engine: _Engine, why: str) -> None:
    """``close(error=why)`` for a blocking engine collected (or left at exit) unclosed."""
    if loop.closed:
        return  # its loop was stopped already: the engine cannot be reached any more
    try:
        loop.call(functools.partial(engine.close, error=why))
    finally:
        loop.close()


def _close_updates(loop: _Loop, agen: Any, why: str) -> None:
    """Close an ``updates()`` async generator on its loop (``why``: unused, the reaper's)."""
    if not loop.closed:
        with contextlib.suppress(Exception):  # the loop stopping meanwhile closes it anyway
            loop.call(agen.aclose)


def _start_connect(cls: type[B], connect: Callable[..., Awaitable[Any]], name: str, /,
                   **kwargs: Any) -> _PendingConnect[B]:
    _start_reaper()  # before the loop: failing to start a thread here leaves nothing open
    loop = _Loop(name)
    try:
        inner = loop.submit(functools.partial(connect, **kwargs))
    except BaseException:
        loop.close()
        raise
    config = kwargs["config"] or EngineConfig()
    label = f"{cls.__name__} for rank {kwargs['rank']} (job {config.job!r})"
    return _PendingConnect(loop, cls, inner, label, 2 * config.abort_grace)


class BlockingTrainer(_Blocking[TrainerEngine]):
    """A ``TrainerEngine`` for synchronous callers, on an event loop thread of its own.

    Close it (``close()`` or a ``with`` block). One garbage-collected unclosed, or still open
    at interpreter exit, warns ``ResourceWarning`` ("BlockingTrainer for rank N (job ...,
    generation G) was never closed") and is then closed on that error by a thread of this
    module, never by the collecting one: on rank 0 the workers' ``receive()`` raises
    ``PeerLostError`` naming it (no clean end of training), and a call still running from a
    kept ``Pending`` ends as at a ``close()`` during it. At exit the process waits for that
    close at most ``2 * config.abort_grace`` seconds.
    """

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
        ``.cancel()`` cancels the connect (as cancelling the coroutine) and stops the loop.
        Collected before either, it warns ``ResourceWarning`` and is cancelled the same way
        (the engine it made, if it finished, closed), off the collecting thread."""
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
        the round nothing happened (READY); during this rank's part of the round it aborts
        the round everywhere and is POISONED; once its part is done, the round ends as on
        every other rank (it may commit: READY, the version advanced, its ``SyncResult`` not
        returned). The interrupt propagates once that is done: read ``version`` and
        ``state`` to tell which.
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
    """A ``WorkerEngine`` for synchronous callers, on an event loop thread of its own.

    Close it (``close()`` or a ``with`` block). One garbage-collected unclosed, or still open
    at interpreter exit, is handled as a ``BlockingTrainer`` is: a ``ResourceWarning``
    ("BlockingWorker for rank N ... was never closed"), then a close on that error (its peers
    read it if a round needed this rank), off the collecting thread and bounded at exit.
    """

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
        stays READY), as on the coroutine: seconds > 0, ``None`` or ``math.inf`` for no
        bound, anything else ``LocalProtocolError``. Errors as the coroutine. Interrupted: while
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
        or this engine is closed (while the iteration waits for a round, or before it asks for
        the next: by the loop body, or by another thread); rank 0 closing on an error raises
        its ``PeerLostError``. Errors and interruption as ``receive``; the iterator must be
        used from one thread.
        """
        agen: AsyncIterator[SyncResult] = self._engine.updates()
        try:
            while True:
                if self._loop.closed:
                    # close() stopped the loop between two rounds: the end, as the async
                    # iterator ends on a closed engine (the loop cannot be asked any more).
                    return
                try:
                    yield self._loop.call(agen.__anext__)
                except StopAsyncIteration:
                    return
                except LocalProtocolError:
                    if self._loop.closed:  # another thread's close() stopped the loop under
                        return  # this very call (the engine's end, not this call's error)
                    raise
        except GeneratorExit:
            # Dropped half-way, maybe by a collection on any thread (the loop's own, or one
            # while the loop is busy): only queued, as a finalizer's close, so it never waits.
            _reap_queue.put((functools.partial(_close_updates, self._loop, agen), "",
                             self._engine.config.abort_grace))
            raise
        except BaseException:
            _close_updates(self._loop, agen, "")  # the caller's own thread: it may wait
            raise
