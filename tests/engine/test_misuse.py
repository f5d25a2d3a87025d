"""A framework's misuse of the engines: what each one raises, on which rank, and the state the
engine is left in.

A ``KeyboardInterrupt`` or ``SystemExit`` raised by a caller's callback (a ``progress``, a
load callback, a lazy source) fails the round at once on every rank, naming the rank whose
callback raised, and reaches that rank's caller as raised; under the blocking facade the
engine's loop thread survives it, so ``close()`` still releases the engine. ``weights`` that
only look iterable (a str, a bare tensor) are refused before the round.
"""

from __future__ import annotations

import threading
import time
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

    targets = {1: {p.spec.name: LoadTarget(p.dst.local_shape(p.spec.shape, 1),
                                           getattr(torch, p.spec.dtype), p.dst.placements,
                                           load)
                   for p in PLAN.params}}
    (t,), (w,) = await _connect_all(MemoryStore(), PLAN, targets=targets)
    try:
        got_t, got_w = await _both(t, w, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        assert isinstance(got_w, SystemExit) and got_w.code == 3
        _failed_for(got_t, 1, f"load callback for parameter {spec.name!r}")
        assert seen == [spec.name]
        assert t.state is w.state is EngineState.POISONED
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


