"""How a rank's leaving reads to its peers, on a ``MemoryStore``: trainer rank 0 leaving its
``async with`` on an exception is no clean end of the job (the workers raise it, their
``updates()`` too); a rank that closes on an error while a round needs it is named with that
error; ``close()`` while this engine's ``receive()`` waits for a round ends the wait with
``LocalProtocolError`` (and an ``updates()`` loop), not with a store loss or never."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from m2n_async import LocalProtocolError, PeerLostError, TransferError, WorkerEngine
from m2n_async.blocking import BlockingTrainer, BlockingWorker
from m2n_async.testing import MemoryStore

from ._plans import make_plan, source_shards
from ._world import TOKEN, store_thread
from .test_engine_local import CFG, DEFS, _close, _connect_all, _round

PLAN = make_plan(DEFS[:1], (1, 1), (1, 1))
PLAN2 = make_plan(DEFS[:1], (1, 2), (1, 1))  # two trainers


async def _follow(worker: Any, got: list[Any]) -> None:
    """The versions ``worker.updates()`` yields, then ``"ended"`` once the loop ends, or
    the ``PeerLostError`` it raises."""
    try:
        async for r in worker.updates():
            got.append(r.version)
    except PeerLostError as exc:
        got.append(exc)
        return
    got.append("ended")


async def _one_round(plan: Any = PLAN) -> tuple[list[Any], list[Any]]:
    trainers, workers = await _connect_all(MemoryStore(), plan)
    await _round(trainers, workers,
                 lambda e: e.sync_weights(source_shards(plan, e.rank, 1)))
    return trainers, workers


@pytest.mark.asyncio
async def test_rank0_leaving_async_with_on_an_error_fails_the_workers_updates() -> None:
    trainers, workers = await _one_round()
    got: list[Any] = []
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follow, workers[0], got)
                await anyio.sleep(0.2)  # the worker waits for round 2
                with pytest.raises(KeyError):
                    async with trainers[0]:
                        raise KeyError("optimizer state")
        assert trainers[0].state.value == "closed"
        exc = got[-1]
        assert isinstance(exc, PeerLostError), got
        assert exc.ranks == (0,)
        assert "trainer rank 0 closed the job on an error (KeyError: 'optimizer state') " \
               "after round 1 of generation 1" in str(exc), exc
        # ... and stays so: receive() raises the same again, updates() does not just end
        with pytest.raises(PeerLostError, match="on an error"):
            await workers[0].receive()
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_clean_exit_still_ends_the_workers_updates() -> None:
    trainers, workers = await _one_round()
    got: list[Any] = []
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follow, workers[0], got)
                await anyio.sleep(0.2)
                async with trainers[0]:
                    pass
        assert got == ["ended"]
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["clean", "error"])
async def test_a_worker_whose_job_ended_is_poisoned(how: str) -> None:
    """Once rank 0 ended the job, the worker can receive no more: its state says so
    (POISONED, not READY: done, not idle), while ``receive()`` keeps raising the job's end
    and ``updates()`` keeps ending (or raising it); ``close()`` then closes it."""
    trainers, workers = await _one_round()
    worker = workers[0]
    got: list[Any] = []
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follow, worker, got)
                await anyio.sleep(0.2)  # the worker waits for round 2
                assert worker.state.value == "ready"
                await trainers[0].close(error=None if how == "clean" else "loss is NaN")
        assert got == ["ended"] if how == "clean" else isinstance(got[0], PeerLostError), got
        assert worker.state.value == "poisoned" and worker.version == 1
        for _ in range(2):
            with pytest.raises(PeerLostError, match="no more rounds") as info:
                await worker.receive()
            assert info.value.ranks == (0,)
            again: list[Any] = []
            await _follow(worker, again)
            assert again == ["ended"] if how == "clean" else isinstance(
                again[0], PeerLostError), again
        async with anyio.create_task_group() as tg:  # close() begun: as for any engine
            tg.start_soon(worker.close)
            await anyio.lowlevel.checkpoint()
            with pytest.raises(LocalProtocolError, match="is closing"):
                await worker.receive()
        assert worker.state.value == "closed"
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_trainer_closing_on_an_error_is_named_with_it_in_the_round() -> None:
    # Trainer 1 refuses its weights before the round (its engine stays READY) and its
    # async with closes it on that error, while rank 0 and the worker are in round 2.
    trainers, workers = await _one_round(PLAN2)
    got: dict[int, Any] = {}

    async def side(r: int, call: Any) -> None:
        try:
            got[r] = await call()
        except Exception as exc:
            got[r] = exc

    async def trainer1() -> None:
        try:
            async with trainers[1]:
                bad = {"w_row": torch.zeros(6, 6, dtype=torch.int64)}
                await trainers[1].sync_weights(bad)
        except Exception as exc:
            got[1] = exc

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(side, 0, lambda: trainers[0].sync_weights(
                    source_shards(PLAN2, 0, 2)))
                tg.start_soon(side, 2, workers[0].receive)
                await anyio.sleep(0.3)  # round 2 under way without trainer 1
                tg.start_soon(trainer1)
        assert "PlanError" in type(got[1]).__name__, got[1]
        for r in (0, 2):
            exc = got[r]
            assert isinstance(exc, TransferError) and (exc.rank, exc.cause) == (1, "left"), exc
            assert "it closed its engine on an error: PlanError: parameter 'w_row'" in str(exc)
        assert str(got[0]) == str(got[2])
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
@pytest.mark.parametrize("owned", [False, True], ids=["shared-store", "engine's-store"])
async def test_close_while_receive_waits_ends_the_wait(owned: bool) -> None:
    store = MemoryStore()
    trainers, workers = await _connect_all(store, PLAN)
    worker = workers[0]
    if owned:  # as connect(address=...) owns its client: close() closes it under the wait
        worker._owns_store = True
    got: list[Any] = []

    async def wait() -> None:
        try:
            await worker.receive()
        except Exception as exc:
            got.append(exc)

    async def follow() -> None:
        got.append([r.version async for r in worker.updates()])

    try:
        for waiter in (wait, follow):
            trainers2, workers2 = await _connect_all(MemoryStore(), PLAN) if got else (
                trainers, workers)
            worker = workers2[0]
            if owned:
                worker._owns_store = True
            t0 = time.monotonic()
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await anyio.sleep(0.2)
                    await worker.close()
            assert time.monotonic() - t0 < 5
            await _close(*trainers2)
        exc, ended = got
        assert isinstance(exc, LocalProtocolError), exc
        assert str(exc) == ("receive on rank 1: the engine was closed while waiting for round "
                            "1 of generation 1")
        assert ended == []  # the loop just ends
    finally:
        await _close(*trainers, *workers)


@pytest.fixture(scope="module")
def address() -> Any:
    with store_thread() as addr:
        yield addr


def _blocking_pair(address: str, job: str) -> tuple[BlockingTrainer, BlockingWorker]:
    spec = [p.spec for p in PLAN.params]
    target = {p.spec.name: (torch.zeros(12, 6), p.dst.placements) for p in PLAN.params}
    cfg = dataclasses.replace(CFG, job=job)
    with ThreadPoolExecutor(2) as ex:  # connect blocks until both ranks shook hands
        ft = ex.submit(BlockingTrainer.connect, address, token=TOKEN, rank=0,
                       trainer_ranks=1, world_size=2, params=spec, config=cfg)
        fw = ex.submit(BlockingWorker.connect, address, token=TOKEN, rank=1,
                       trainer_ranks=1, world_size=2, targets=target, config=cfg)
        return ft.result(60), fw.result(60)


def test_blocking_close_from_another_thread_ends_a_waiting_receive(address: str) -> None:
    trainer, worker = _blocking_pair(address, "close-reasons-wait")
    try:
        with ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(worker.receive)
            time.sleep(0.3)
            worker.close()
            with pytest.raises(LocalProtocolError, match="closed while waiting for round 1"):
                waiting.result(10)
    finally:
        worker.close()
        trainer.close()
    assert not [t for t in threading.enumerate() if t.name == "m2n-async-worker1"]


def test_blocking_with_block_left_on_an_error_tells_the_workers(address: str) -> None:
    trainer, worker = _blocking_pair(address, "close-reasons-error")
    try:
        with ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(worker.receive)
            time.sleep(0.3)
            with pytest.raises(RuntimeError), trainer:
                raise RuntimeError("loss is NaN")
            with pytest.raises(PeerLostError, match=r"on an error \(RuntimeError: loss is NaN\)"):
                waiting.result(10)
    finally:
        worker.close()
        trainer.close()
    assert isinstance(worker, BlockingWorker) and not isinstance(worker, WorkerEngine)


@pytest.mark.asyncio
async def test_a_receive_begun_while_close_runs_is_refused() -> None:
    # close() is in its shielded teardown (its error note first), the engine still READY: a
    # receive() called now must not start a wait nothing would end (shared store: for ever).
    trainers, workers = await _one_round()
    worker = workers[0]
    got: list[Any] = []

    async def late_receive() -> None:
        try:
            got.append(await worker.receive())
        except Exception as exc:
            got.append(exc)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: worker.close(error="shutting down"))
                await anyio.lowlevel.checkpoint()
                assert worker._closing and worker.state.value == "ready"
                tg.start_soon(late_receive)
        assert len(got) == 1 and isinstance(got[0], LocalProtocolError), got
        assert "is closing" in str(got[0])
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_cancelled_or_exited_block_ends_the_job_cleanly() -> None:
    # A time box around the training loop (or sys.exit(0) in it) is an ordinary end: the
    # workers' updates() just ends, as after a block that finished.
    for stop in ("cancel", "exit"):
        trainers, workers = await _one_round()
        got: list[Any] = []
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_follow, workers[0], got)
                    await anyio.sleep(0.2)
                    if stop == "cancel":
                        with anyio.move_on_after(0.05):
                            async with trainers[0]:
                                await anyio.sleep_forever()
                    else:
                        with pytest.raises(SystemExit):
                            async with trainers[0]:
                                raise SystemExit(0)
            assert got == ["ended"], (stop, got)
        finally:
            await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_trainer_whose_job_ended_leaves_cleanly() -> None:
    # Trainer 1 asks for a round after rank 0 ended the job: it is told so, and its close()
    # is a clean leave (its keys withdrawn), not a departure as lost, as for a worker.
    trainers, workers = await _one_round(PLAN2)
    released: list[str | None] = []
    real = trainers[1]._release

    async def release(*, abort_reason: str | None = None) -> None:
        released.append(abort_reason)
        await real(abort_reason=abort_reason)

    trainers[1]._release = release  # type: ignore[method-assign]
    try:
        with anyio.fail_after(30):
            await trainers[0].close()
            with pytest.raises(PeerLostError, match="no more rounds"):
                await trainers[1].sync_weights(source_shards(PLAN2, 1, 2))
            await trainers[1].close()
        assert released == [None], released
    finally:
        await _close(*trainers, *workers)
