"""A framework's misuse of the engines: what each one raises, on which rank, and the state the
engine is left in.

A ``KeyboardInterrupt`` or ``SystemExit`` raised by a caller's callback (a ``progress``, a
load callback, a lazy source) fails the round at once on every rank, naming the rank whose
callback raised, and reaches that rank's caller as raised; under the blocking facade the
engine's loop thread survives it, so ``close()`` still releases the engine. ``weights`` that
only look iterable (a str, a bare tensor) are refused before the round.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest
import torch

from m2n_async import (
    EngineState,
    LoadTarget,
    LocalProtocolError,
    PlanError,
    TrainerEngine,
    TransferError,
    WorkerEngine,
)
from m2n_async.testing import MemoryStore

from ._plans import make_plan, source_shards
from ._world import store_thread
from .test_blocking import _full, _pair
from .test_engine_local import DEFS, _close, _connect_all

PLAN = make_plan(DEFS[:2], (1, 1), (1, 1))


async def _both(trainer: TrainerEngine, worker: WorkerEngine,
                send: Callable[[TrainerEngine], Any],
                receive: Callable[[WorkerEngine], Any] | None = None
                ) -> tuple[BaseException | Any, BaseException | Any]:
    """One round; what each side returned or raised (BaseExceptions included)."""
    out: dict[str, Any] = {}

    async def run(key: str, call: Callable[[], Any]) -> None:
        try:
            out[key] = await call()
        except BaseException as exc:  # the test inspects it
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            out[key] = exc

    # Well inside the round deadline (20 s): the failure must be heard at once, not at it.
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "t", lambda: send(trainer))
            tg.start_soon(run, "w", lambda: (receive or WorkerEngine.receive)(worker))
    return out["t"], out["w"]


def _loaded_by(load: Callable[[str, torch.Tensor], Any]) -> dict[int, dict[str, Any]]:
    """Worker rank 1's targets: every parameter of ``PLAN`` a ``LoadTarget`` calling
    ``load``."""
    return {1: {p.spec.name: LoadTarget(p.dst.local_shape(p.spec.shape, 1),
                                        getattr(torch, p.spec.dtype), p.dst.placements, load)
                for p in PLAN.params}}


def _failed_for(exc: Any, rank: int, what: str) -> None:
    assert isinstance(exc, TransferError), exc
    assert exc.rank == rank and exc.cause == "error", (exc.rank, exc.cause, str(exc))
    assert what in str(exc), str(exc)


@pytest.mark.asyncio
async def test_keyboard_interrupt_in_a_progress_callback_fails_the_round_at_once() -> None:
    (t,), (w,) = await _connect_all(MemoryStore(), PLAN)

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt("stop")

    try:
        got_t, got_w = await _both(t, w, lambda e: e.sync_weights(source_shards(PLAN, 0, 1),
                                                                   progress=interrupt))
        assert isinstance(got_t, KeyboardInterrupt) and str(got_t) == "stop"
        assert isinstance(got_t.__context__, TransferError)  # the round's error, as context
        _failed_for(got_w, 0, "progress callback raised KeyboardInterrupt('stop')")
        assert t.state is w.state is EngineState.POISONED
    finally:
        await _close(t, w)
    assert t.state is w.state is EngineState.CLOSED


@pytest.mark.asyncio
async def test_system_exit_in_a_load_callback_fails_the_round_at_once() -> None:
    spec = PLAN.params[0].spec
    seen: list[str] = []

    def load(name: str, tensor: torch.Tensor) -> None:
        seen.append(name)
        raise SystemExit(3)

    (t,), (w,) = await _connect_all(MemoryStore(), PLAN, targets=_loaded_by(load))
    try:
        got_t, got_w = await _both(t, w, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        assert isinstance(got_w, SystemExit) and got_w.code == 3
        _failed_for(got_t, 1, f"load callback for parameter {spec.name!r}")
        assert seen == [spec.name]
        assert t.state is w.state is EngineState.POISONED
    finally:
        await _close(t, w)


async def _load_async(name: str, tensor: torch.Tensor) -> None:  # never awaited
    raise AssertionError("an async load callback's body ran")


class _AsyncCall:
    async def __call__(self, *args: Any) -> None:
        raise AssertionError("an async __call__ ran")


@pytest.mark.parametrize("load", [_load_async, _AsyncCall(),
                                  functools.partial(_load_async, "bound")],
                         ids=["async-def", "async-call", "partial"])
def test_an_async_load_callback_is_refused_when_declared(load: Any) -> None:
    # called on a thread and never awaited, its copy would never happen while the round
    # committed a version
    with pytest.raises(PlanError, match=r"LoadTarget\.load must be a plain function"):
        LoadTarget((4,), torch.float32, None, load)


@pytest.mark.asyncio
async def test_a_load_callback_that_returns_an_awaitable_fails_the_round() -> None:
    # a plain function handing back a coroutine (``lambda n, t: copy_async(n, t)``) passes
    # the declaration; what it returns fails the round naming the parameter, instead of a
    # version committed with the target never written
    spec = PLAN.params[0].spec

    def load(name: str, tensor: torch.Tensor) -> Any:
        return _load_async(name, tensor)

    (t,), (w,) = await _connect_all(MemoryStore(), PLAN, targets=_loaded_by(load))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the coroutine is closed, not left unawaited
            got_t, got_w = await _both(t, w,
                                       lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        for got in (got_t, got_w):
            _failed_for(got, 1, f"load callback for parameter {spec.name!r}")
            assert "returned coroutine, an awaitable" in str(got), str(got)
        assert t.state is w.state is EngineState.POISONED
    finally:
        await _close(t, w)


@pytest.mark.asyncio
async def test_an_async_progress_callback_is_refused_at_once() -> None:
    (t,), (w,) = await _connect_all(MemoryStore(), PLAN)

    async def progress(done: int, total: int) -> None:
        raise AssertionError("never awaited")

    try:
        with pytest.raises(LocalProtocolError, match="progress must be a plain function"):
            await t.sync_weights(source_shards(PLAN, 0, 1), progress=progress)
        with pytest.raises(LocalProtocolError, match="progress must be a plain function"):
            await w.receive(progress=progress)
        assert t.state is w.state is EngineState.READY  # nothing happened
        got_t, got_w = await _both(t, w, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        assert got_t.version == got_w.version == 1
    finally:
        await _close(t, w)


@pytest.mark.asyncio
async def test_keyboard_interrupt_in_a_weights_callable_fails_the_round_at_once() -> None:
    (t,), (w,) = await _connect_all(MemoryStore(), PLAN)

    def source(names: Any) -> Any:
        raise KeyboardInterrupt

    try:
        got_t, got_w = await _both(t, w, lambda e: e.sync_weights(source))
        assert isinstance(got_t, KeyboardInterrupt)
        _failed_for(got_w, 0, "the weights source raised KeyboardInterrupt()")
        assert t.state is w.state is EngineState.POISONED
    finally:
        await _close(t, w)


@pytest.mark.asyncio
@pytest.mark.parametrize("weights", ["w_row", b"w_row", torch.zeros(12, 6)],
                         ids=["str", "bytes", "tensor"])
async def test_weights_that_only_look_iterable_are_refused_before_the_round(
        weights: Any) -> None:
    (t,), (w,) = await _connect_all(MemoryStore(), PLAN)
    try:
        with pytest.raises(LocalProtocolError, match="weights must be a Mapping"):
            await t.sync_weights(weights)
        assert t.state is EngineState.READY  # nothing sent: the engine goes on
        got_t, got_w = await _both(t, w, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        assert got_t.version == got_w.version == 1
    finally:
        await _close(t, w)


@pytest.fixture(scope="module")
def address() -> Any:
    with store_thread() as addr:
        yield addr


def test_blocking_keyboard_interrupt_in_a_progress_callback_keeps_the_loop(
        address: str) -> None:
    trainer, worker, _ = _pair(address, "misuse-blocking-progress")

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt("stop")

    loops = [trainer._loop.portal.call(threading.current_thread),
             worker._loop.portal.call(threading.current_thread)]
    try:
        with ThreadPoolExecutor(1) as ex:
            got = ex.submit(worker.receive)
            with pytest.raises(KeyboardInterrupt, match="stop"):
                trainer.sync_weights({"w": _full(1)}, progress=interrupt)
            with pytest.raises(TransferError, match="progress callback") as info:
                got.result(10)  # at once, not at the round deadline (20 s)
        assert info.value.rank == 0 and info.value.cause == "error"
        assert trainer.state is worker.state is EngineState.POISONED
        assert all(t.is_alive() for t in loops), "an engine's loop thread died"
    finally:
        trainer.close()
        worker.close()
    assert trainer.state is worker.state is EngineState.CLOSED
    for t in loops:
        t.join(10)
        assert not t.is_alive()


def test_blocking_result_after_cancel_says_it_was_cancelled(address: str) -> None:
    trainer, worker, _ = _pair(address, "misuse-blocking-cancel")
    try:
        pending = worker.start_receive()
        time.sleep(0.1)  # waiting for round 1 to start
        pending.cancel()
        assert worker.state is EngineState.READY
        with pytest.raises(LocalProtocolError, match=r"cancelled by its Pending\.cancel"):
            pending.result(1)
    finally:
        trainer.close()
        worker.close()


