"""The blocking facade (``m2n_async.blocking``): engines on their own loop threads.

One trainer and one worker in this process, each a ``Blocking*`` engine with its own event
loop thread (a blocking portal), over a TCP store served from a third thread and a real Gloo
data plane: rounds bit-exact from plain threads, ``timeout`` and interruption semantics as
the async API's, ``updates()`` ending when the trainer closes, and ``close`` idempotent.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from m2n_async import (
    REPLICATE,
    BlockingTrainer,
    BlockingWorker,
    EngineConfig,
    EngineState,
    Layout,
    LocalProtocolError,
    Mesh,
    ParamSpec,
    TransferError,
)

from ._world import TOKEN, store_thread

CFG = EngineConfig(transport="gloo", phase_timeout=20, round_timeout=20, abort_grace=2,
                   host="127.0.0.1")
SHAPE = (8, 6)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with store_thread() as addr:
        yield addr


def _full(version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(version)
    return torch.randn(SHAPE, generator=g)


def _pair(address: str, job: str) -> tuple[BlockingTrainer, BlockingWorker, torch.Tensor]:
    # One trainer holding the whole tensor, one worker holding it too.
    spec = ParamSpec("w", torch.float32, SHAPE, Layout(Mesh((1, 1)), None))
    target = torch.zeros(SHAPE)
    with ThreadPoolExecutor(2) as ex:  # connect blocks until both ranks shook hands
        ft = ex.submit(BlockingTrainer.connect, address, token=TOKEN, rank=0,
                       trainer_ranks=1, world_size=2, params=[spec],
                       config=dataclasses.replace(CFG, job=job))
        fw = ex.submit(BlockingWorker.connect, address, token=TOKEN, rank=1,
                       trainer_ranks=1, world_size=2, targets={"w": (target, None)},
                       config=dataclasses.replace(CFG, job=job))
        return ft.result(60), fw.result(60), target


def _in_thread(fn: Callable[[], Any]) -> Any:
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(fn)


def test_rounds_from_plain_threads_are_bit_exact(address: str) -> None:
    trainer, worker, target = _pair(address, "blocking-rounds")
    with trainer, worker:
        assert trainer.state is EngineState.READY and worker.state is EngineState.READY
        for v in (1, 2, 3):
            with ThreadPoolExecutor(1) as ex:
                got = ex.submit(worker.receive)
                sent = trainer.sync_weights({"w": _full(v)})
                res = got.result(30)
            assert sent.version == res.version == v == worker.version
            assert torch.equal(target, _full(v))
        # The loops are threads of their own, named after the rank.
        names = {t.name for t in threading.enumerate()}
        assert {"m2n-async-trainer0", "m2n-async-worker1"} <= names
    assert trainer.state is EngineState.CLOSED and worker.state is EngineState.CLOSED
    trainer.close()  # idempotent
    worker.close()
    with pytest.raises(LocalProtocolError, match="closed"):
        trainer.sync_weights({"w": _full(9)})


def test_receive_timeout_leaves_the_engine_ready_and_updates_end_on_close(
        address: str) -> None:
    trainer, worker, target = _pair(address, "blocking-timeout")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no round 1 started"):
            worker.receive(timeout=0.3)
        assert time.monotonic() - t0 < 10
        assert worker.state is EngineState.READY

        def consume() -> list[int]:
            return [r.version for r in worker.updates()]

        with ThreadPoolExecutor(1) as ex:
            versions = ex.submit(consume)
            trainer.sync_weights({"w": _full(1)})
            trainer.sync_weights({"w": _full(2)})
            trainer.close()  # rank 0 ends the job: the workers' updates() ends
            assert versions.result(30) == [1, 2]
        assert torch.equal(target, _full(2))
    finally:
        trainer.close()
        worker.close()


def test_interrupt_while_waiting_for_a_round_cancels_it_and_keeps_the_engine(
        address: str) -> None:
    trainer, worker, _target = _pair(address, "blocking-interrupt")
    try:
        # Ctrl-C in the main thread while it blocks in receive(): the wait is cancelled on
        # the loop (nothing happened: still READY) and the interrupt reaches the caller.
        main = threading.main_thread().ident
        assert main is not None and threading.get_ident() == main
        # Python's own SIGINT handler, whatever this process inherited: a shell starts a
        # background job with SIGINT ignored, and Python then installs no handler at all.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                worker.receive(timeout=20)
            timer.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        assert worker.state is EngineState.READY
        with ThreadPoolExecutor(1) as ex:  # and the engine still works
            got = ex.submit(worker.receive)
            trainer.sync_weights({"w": _full(5)})
            assert got.result(30).version == 1
    finally:
        trainer.close()
        worker.close()


def test_connect_failure_stops_the_loop_thread(address: str) -> None:
    before = {t.name for t in threading.enumerate()}
    spec = ParamSpec("w", torch.float32, SHAPE, Layout(Mesh((1, 1)), (0, REPLICATE)))
    with pytest.raises(LocalProtocolError, match="rank < trainer_ranks"):
        BlockingTrainer.connect(address, token=TOKEN, rank=3, trainer_ranks=1,
                                world_size=2, params=[spec], config=CFG)
    time.sleep(0.1)
    assert "m2n-async-trainer3" not in {t.name for t in threading.enumerate()} - before


def test_close_refused_on_the_loop_thread_leaves_a_later_close_working(address: str) -> None:
    # close() on the engine's own loop thread (where a progress callback runs) is refused,
    # and before anything changed: a close() from a proper thread still closes the engine
    # and stops the loop thread.
    trainer, worker, _ = _pair(address, "blocking-close-on-loop")
    try:
        loop_thread = trainer._loop.portal.call(threading.current_thread)
        with pytest.raises(LocalProtocolError, match="own event loop thread"):
            trainer._loop.portal.call(trainer.close)
        assert trainer.state is EngineState.READY
        trainer.close()
        assert trainer.state is EngineState.CLOSED
        loop_thread.join(10)
        assert not loop_thread.is_alive(), "the loop thread still runs after close()"
    finally:
        trainer.close()
        worker.close()


def test_waiting_on_the_loop_thread_is_refused_and_wedges_nothing(address: str) -> None:
    # A progress callback runs on the engine's loop thread: cancelling or waiting for the
    # round's Pending there, or calling the engine again, would wait for the loop itself.
    # Each is refused (the callback's error fails the round), and the engines still close.
    trainer, worker, _ = _pair(address, "blocking-wait-on-loop")
    tried: dict[str, BaseException] = {}
    pending: list[Any] = []

    def progress(done: int, total: int) -> None:
        deadline = time.monotonic() + 10
        while not pending:  # start_sync_weights has returned on the test's thread
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for what, call in (("cancel", pending[0].cancel), ("result", pending[0].result),
                           ("sync", lambda: trainer.sync_weights({"w": _full(2)}))):
            try:
                call()
            except BaseException as exc:  # the test inspects it
                tried[what] = exc
        raise RuntimeError("stop")

    try:
        with ThreadPoolExecutor(1) as ex:
            got = ex.submit(worker.receive, timeout=30)
            pending.append(trainer.start_sync_weights({"w": _full(1)}, progress=progress))
            with pytest.raises(TransferError, match="stop"):
                pending[0].result(30)
            with pytest.raises(TransferError):
                got.result(30)
        assert sorted(tried) == ["cancel", "result", "sync"], tried
        for exc in tried.values():
            assert isinstance(exc, LocalProtocolError), tried
            assert "own event loop thread" in str(exc), tried
    finally:
        t0 = time.monotonic()
        trainer.close()
        worker.close()
        assert time.monotonic() - t0 < 15
    assert trainer.state is EngineState.CLOSED


@pytest.mark.asyncio
async def test_a_blocking_call_inside_a_running_loop_warns_at_the_callers_line(
        address: str) -> None:
    # It blocks that loop until it returns (a store served there could not answer): the
    # warning says so, pointing at the caller's line, not the facade's.
    spec = ParamSpec("w", torch.float32, SHAPE, Layout(Mesh((1, 1)), (0, REPLICATE)))
    with pytest.warns(RuntimeWarning, match="inside a running asyncio event loop") as seen, \
            pytest.raises(LocalProtocolError, match="rank < trainer_ranks"):
        BlockingTrainer.connect(address, token=TOKEN, rank=3, trainer_ranks=1,
                                world_size=2, params=[spec], config=CFG)
    assert seen[0].filename == __file__, seen[0].filename


class _LateFuture:
    """A test double of the connect's future: its first timed wait expires just as the
    connect completes (the future is done when the ``TimeoutError`` is seen)."""

    def __init__(self, real: Any) -> None:
        self._real, self._first = real, True

    def result(self, timeout: float | None = None) -> Any:
        if self._first and timeout is not None:
            self._first = False
            self._real.exception()  # waits until it finished
            raise TimeoutError  # the wait's own expiry, raced by the completion
        return self._real.result(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_a_connect_that_finishes_as_its_wait_expires_is_handed_out(address: str) -> None:
    # result(timeout) must not take that race for the connect's own TimeoutError: that
    # closed the loop under the engine just made (its peers saw it lost, and a later
    # result() wrapped an engine whose loop was gone).
    spec = ParamSpec("w", torch.float32, SHAPE, Layout(Mesh((1, 1)), None))
    target = torch.zeros(SHAPE)
    config = dataclasses.replace(CFG, job="blocking-late-connect")
    pending = BlockingTrainer.start_connect(address, token=TOKEN, rank=0, trainer_ranks=1,
                                           world_size=2, params=[spec], config=config)
    pending._future = _LateFuture(pending._future)  # type: ignore[attr-defined]
    with ThreadPoolExecutor(1) as ex:
        fw = ex.submit(BlockingWorker.connect, address, token=TOKEN, rank=1, trainer_ranks=1,
                       world_size=2, targets={"w": (target, None)}, config=config)
        trainer = pending.result(timeout=30)
        worker = fw.result(60)
    with trainer, worker:
        assert trainer.state is EngineState.READY
        assert pending.result() is trainer
        with ThreadPoolExecutor(1) as ex:
            got = ex.submit(worker.receive)
            assert trainer.sync_weights({"w": _full(1)}).version == 1
            assert got.result(30).version == 1
        assert torch.equal(target, _full(1))
