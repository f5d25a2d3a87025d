"""The worker's receive API under pressure: ``receive(timeout=)``, ``updates()``, and their
blocking counterparts, against what their docstrings promise.

Cancellation at each point of a round (waiting for it, as it starts, mid-way, once this
rank's part is done), timeout values that bound no wait, concurrent calls, iterators left
early or closed, ``close()`` beside a waiting call, trainers that leave between rounds, and
versions that arrive once each, in order. Every rank is a task of one event loop over a
``MemoryStore`` (real Gloo underneath), 1 trainer + 1 worker unless a case needs more; the
blocking cases use the session's TCP store, for the facade runs its own loop thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest

from m2n_async import (
    BlockingTrainer,
    BlockingWorker,
    EnginePoisonedError,
    EngineState,
    LocalProtocolError,
    PeerLostError,
    SyncResult,
    TransferError,
)
from m2n_async._engine._round import RoundDriver
from m2n_async.testing import MemoryStore

from ._matrix import CFG, DEFS, LIMIT, World, _targets, started, until, waiting, world
from ._plans import make_plan, source_shards
from ._world import TOKEN

# -- timeout= ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_timeout_that_bounds_no_wait_is_refused_and_the_round_still_comes() -> None:
    async with world() as w:
        wk = w.workers[0]
        bad: list[Any] = [0, 0.0, -1, -math.inf, math.nan, True, "5"]
        for value in bad:
            with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError, match="timeout"):
                await wk.receive(timeout=value)
            assert wk.state is EngineState.READY, value
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.send, 1)
            await started(w, 1)
            # The round has started: a zero timeout must not say that none did.
            with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError, match="timeout"):
                await wk.receive(timeout=0)
            with anyio.fail_after(LIMIT):
                got = await wk.receive(timeout=math.inf)  # no bound, as None
        assert (got.version, got.round) == (1, 1) and w.holds(1)
        assert w.trainers[0].version == 1


@pytest.mark.asyncio
async def test_a_tiny_timeout_is_a_timeout_that_changes_nothing() -> None:
    async with world() as w:
        wk = w.workers[0]
        with anyio.fail_after(LIMIT), pytest.raises(TimeoutError, match="no round 1 started"):
            await wk.receive(timeout=1e-9)
        assert wk.state is EngineState.READY and wk.version == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.send, 1)
            with anyio.fail_after(LIMIT):
                got = await wk.receive(timeout=LIMIT)
        assert (got.version, got.round) == (1, 1) and w.holds(1)


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancelled_while_waiting_then_the_next_receive_takes_that_round() -> None:
    async with world() as w:
        wk = w.workers[0]
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                async def cancel_when_waiting() -> None:
                    await until(lambda: waiting(wk))
                    scope.cancel()
                tg.start_soon(cancel_when_waiting)
                await wk.receive()
        assert scope.cancelled_caught
        assert wk.state is EngineState.READY and wk._busy is None and wk.version == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.send, 1)
            await started(w, 1)  # the trainer is in round 1 and waits for this worker
            with anyio.fail_after(LIMIT):
                got = await wk.receive()
        assert (got.version, got.round) == (1, 1) and w.holds(1)


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["published", "publishing"])
async def test_cancelled_waiting_once_the_round_started_fails_it_at_once_naming_this_worker(
        when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    far, prompt = 60, 15  # the round deadline, and the generous bound its failure is held to
    async with world() as w:
        wk = w.workers[0]
        scope = anyio.CancelScope()
        if when == "published":
            wait_start = RoundDriver.wait_start

            async def cancelled_wait(self: RoundDriver, k: int, **kw: Any) -> Any:
                if self.rank != wk.rank:
                    return await wait_start(self, k, **kw)
                await started(w, k)  # the trainer published round k; the wait has not seen it
                scope.cancel()
                await anyio.sleep_forever()  # the cancel lands here, in the wait
            monkeypatch.setattr(RoundDriver, "wait_start", cancelled_wait)
        else:
            looked = RoundDriver.cancelled_waiting

            async def late_look(self: RoundDriver, k: int) -> Any:
                await started(w, k)  # the start lands between the cancel and the look
                return await looked(self, k)
            monkeypatch.setattr(RoundDriver, "cancelled_waiting", late_look)
        errors: list[BaseException] = []

        async def trainer() -> None:
            try:
                await w.send(1, timeout=far)
            except TransferError as exc:
                errors.append(exc)

        with anyio.fail_after(prompt):
            async with anyio.create_task_group() as tg:
                if when == "publishing":
                    async def cancel_then_publish() -> None:
                        await until(lambda: waiting(wk))
                        scope.cancel()  # no start yet: it is published while this is cancelled
                        tg.start_soon(trainer)
                    tg.start_soon(cancel_then_publish)
                else:
                    tg.start_soon(trainer)
                with scope:
                    await wk.receive()
        assert scope.cancelled_caught
        assert wk.state is EngineState.POISONED and wk.version == 0
        [exc] = errors
        assert isinstance(exc, TransferError)
        assert (exc.rank, exc.cause, exc.round) == (wk.rank, "cancelled", 1), exc
        assert w.trainers[0].state is EngineState.POISONED and w.trainers[0].version == 0
        with pytest.raises(EnginePoisonedError) as info:
            await wk.receive()
        assert str(info.value.__cause__) == str(exc)  # the record that every rank raised


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["start", "mid"])
async def test_cancelled_in_the_round_fails_it_everywhere_naming_this_worker(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with world() as w:
        wk = w.workers[0]
        scope = anyio.CancelScope()
        progress = None
        if where == "start":
            run = RoundDriver.run

            async def cancelled_run(self: RoundDriver, *a: Any, **kw: Any) -> Any:
                if self.rank == wk.rank:  # the round began on this worker: cancel it now
                    scope.cancel()
                return await run(self, *a, **kw)
            monkeypatch.setattr(RoundDriver, "run", cancelled_run)
        else:
            def progress(done: int, total: int) -> None:  # a bucket arrived: mid-round
                scope.cancel()
        errors: list[BaseException] = []

        async def trainer() -> None:
            try:
                await w.send(1)
            except TransferError as exc:
                errors.append(exc)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer)
                with scope:
                    await wk.receive(progress=progress)
        assert scope.cancelled_caught
        assert wk.state is EngineState.POISONED and wk.version == 0
        [exc] = errors
        assert isinstance(exc, TransferError)
        assert (exc.rank, exc.cause, exc.round) == (wk.rank, "cancelled", 1), exc
        assert w.trainers[0].version == 0
        with pytest.raises(EnginePoisonedError) as info:
            await wk.receive()
        assert info.value.__cause__ is not None


@pytest.mark.asyncio
async def test_cancelled_once_its_part_is_done_commits_and_loses_no_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with world() as w:
        wk = w.workers[0]
        scope = anyio.CancelScope()
        outcome = RoundDriver._outcome

        async def cancelled_outcome(self: RoundDriver, *a: Any, **kw: Any) -> Any:
            if self.rank == wk.rank:  # this worker's part is done: the outcome is shielded
                scope.cancel()
            return await outcome(self, *a, **kw)
        monkeypatch.setattr(RoundDriver, "_outcome", cancelled_outcome)
        sent: list[SyncResult] = []

        async def trainer() -> None:
            sent.append(await w.send(1))

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer)
                with scope:
                    await wk.receive()
        assert scope.cancelled_caught  # the cancel took effect after the commit
        assert wk.state is EngineState.READY and wk.version == 1 and sent[0].version == 1
        assert w.holds(1)
        monkeypatch.setattr(RoundDriver, "_outcome", outcome)
        async with anyio.create_task_group() as tg:  # the next receive is the next round
            tg.start_soon(w.send, 2)
            with anyio.fail_after(LIMIT):
                got = await wk.receive()
        assert (got.version, got.round) == (2, 2) and w.holds(2)


# -- one call at a time --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_second_receive_or_one_beside_a_waiting_updates_is_refused() -> None:
    async with world() as w:
        wk = w.workers[0]
        got: list[int] = []

        async def first() -> None:
            got.append((await wk.receive()).version)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await until(lambda: waiting(wk))
            with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError,
                                                        match="already in receive"):
                await wk.receive()
            assert waiting(wk)  # the first call waits on, unaffected
            await w.send(1)
        assert got == [1]

        async def loop() -> None:
            async for u in wk.updates():
                got.append(u.version)

        async with anyio.create_task_group() as tg:
            tg.start_soon(loop)
            await until(lambda: waiting(wk))
            with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError,
                                                        match="already in receive"):
                await wk.receive()
            await w.send(2)
            await w.trainers[0].close()  # the loop ends
        assert got == [1, 2] and w.holds(2)


# -- updates() -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_leaving_updates_early_loses_no_round_and_delivers_none_twice() -> None:
    async with world() as w:
        wk = w.workers[0]
        got: list[tuple[str, int, int]] = []
        sent: list[int] = []

        async def trainer() -> None:
            for v in (1, 5, 6, 9, 10):  # versions jump: rank 0 passes its own
                sent.append((await w.send(v, version=v)).version)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer)
                it = wk.updates()
                async for u in it:  # left early, not closed
                    got.append(("first", u.version, u.round))
                    break
                assert wk.state is EngineState.READY and wk._busy is None
                r = await wk.receive()  # while that iterator is suspended
                got.append(("receive", r.version, r.round))
                async for u in wk.updates():  # a second iterator, left early too
                    got.append(("second", u.version, u.round))
                    if u.round == 3:
                        break
                got.append(("first", *(lambda u: (u.version, u.round))(await anext(it))))
                await it.aclose()
                with pytest.raises(StopAsyncIteration):
                    await anext(it)
                r = await wk.receive()
                got.append(("receive", r.version, r.round))
        assert got == [("first", 1, 1), ("receive", 5, 2), ("second", 6, 3),
                       ("first", 9, 4), ("receive", 10, 5)]
        assert sent == [1, 5, 6, 9, 10] and wk.version == 10 and w.holds(10)


@pytest.mark.asyncio
async def test_updates_cancelled_while_waiting_keeps_the_engine() -> None:
    async with world() as w:
        wk = w.workers[0]
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def cancel_when_waiting() -> None:
                    await until(lambda: waiting(wk))
                    scope.cancel()
                tg.start_soon(cancel_when_waiting)
                async for _ in wk.updates():
                    pytest.fail("no round was started")
        assert scope.cancelled_caught and wk.state is EngineState.READY
        versions: list[int] = []
        async with anyio.create_task_group() as tg:
            async def loop() -> None:
                async for u in wk.updates():
                    versions.append(u.version)
            tg.start_soon(loop)
            await w.send(1)
            await w.trainers[0].close()
        assert versions == [1]


# -- close() beside a receive -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_close_ends_a_waiting_receive_and_updates_at_once() -> None:
    async with world() as w:
        wk = w.workers[0]
        async with anyio.create_task_group() as tg:
            async def wait() -> None:
                with pytest.raises(LocalProtocolError, match="closed while waiting for round 1"):
                    await wk.receive()
            tg.start_soon(wait)
            await until(lambda: waiting(wk))
            with anyio.fail_after(LIMIT):
                await wk.close()
        assert wk.state is EngineState.CLOSED
        with pytest.raises(LocalProtocolError, match="CLOSED"):
            await wk.receive()
        async for _ in wk.updates():  # a closed engine's updates() ends at once
            pytest.fail("a closed engine delivered a round")

    async with world() as w:  # an updates() loop: waiting, then closed in its body
        wk = w.workers[0]
        versions: list[int] = []
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                async def loop() -> None:
                    async for u in wk.updates():
                        versions.append(u.version)
                tg.start_soon(loop)
                await until(lambda: waiting(wk))
                await wk.close()
        assert versions == []

    async with world() as w:
        wk = w.workers[0]
        versions = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.send, 1)
            with anyio.fail_after(LIMIT):
                async for u in wk.updates():
                    versions.append(u.version)
                    await wk.close()  # the loop's own body closes the engine: the loop ends
        assert versions == [1] and wk.state is EngineState.CLOSED


# -- trainers that leave between rounds ----------------------------------------------------


@pytest.mark.asyncio
async def test_rank_0_closing_between_rounds_ends_the_job_on_the_worker() -> None:
    async with world() as w:
        wk = w.workers[0]
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.send, 1)
            with anyio.fail_after(LIMIT):
                await wk.receive()
        async with anyio.create_task_group() as tg:
            async def wait() -> None:
                with pytest.raises(PeerLostError) as info:
                    await wk.receive()
                errors.append(info.value)
            errors: list[PeerLostError] = []
            tg.start_soon(wait)
            await until(lambda: waiting(wk))
            with anyio.fail_after(LIMIT):
                await w.trainers[0].close()
        [exc] = errors
        assert exc.ranks == (0,)
        assert "trainer rank 0 closed the job after round 1 of generation" in str(exc)
        assert wk.state is EngineState.POISONED and wk.version == 1
        with pytest.raises(PeerLostError) as again:  # told again, as it was told first
            await wk.receive(timeout=LIMIT)
        assert str(again.value) == str(exc)
        async for _ in wk.updates():
            pytest.fail("a job that ended delivered a round")


@pytest.mark.asyncio
async def test_rank_0_closing_on_an_error_makes_updates_raise_it() -> None:
    async with world() as w:
        wk = w.workers[0]
        versions: list[int] = []

        async def loop() -> None:
            with pytest.raises(PeerLostError, match=r"on an error \(KeyError: 'optimizer'\)"):
                async for u in wk.updates():
                    versions.append(u.version)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(loop)
                await w.send(1)
                await w.trainers[0].close(error=KeyError("optimizer"))
        assert versions == [1] and wk.state is EngineState.POISONED


@pytest.mark.asyncio
async def test_rank_0_lost_between_rounds_fails_the_waiting_updates_naming_it() -> None:
    async with world() as w:
        wk = w.workers[0]
        versions: list[int] = []
        errors: list[TransferError] = []

        async def loop() -> None:
            try:
                async for u in wk.updates():
                    versions.append(u.version)
            except TransferError as exc:
                errors.append(exc)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(loop)
                await w.send(1)
                await until(lambda: waiting(wk))
                await w.trainers[0]._store.aclose()  # its process died: its session ends
        assert versions == [1]
        [exc] = errors
        assert (exc.rank, exc.cause, exc.round) == (0, "lost", 2), exc
        assert "rank 0 (trainer) was lost" in str(exc)
        assert wk.state is EngineState.POISONED and wk.version == 1


@pytest.mark.asyncio
async def test_a_trainer_leaving_between_rounds_fails_the_next_round_naming_it() -> None:
    async with world(trainers=2, workers=2) as w:
        errors: dict[int, BaseException] = {}

        async def guard(rank: int, call: Callable[[], Any]) -> None:
            try:
                await call()
            except TransferError as exc:
                errors[rank] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(w.send, 1, 0)
            tg.start_soon(w.send, 1, 1)
            for e in w.workers:
                tg.start_soon(e.receive)
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                for e in w.workers:
                    tg.start_soon(guard, e.rank, e.receive)
                await until(lambda: all(waiting(e) for e in w.workers))
                await w.trainers[1].close()  # cleanly, between rounds
                assert all(e.state is EngineState.READY for e in w.workers)
                tg.start_soon(guard, 0, lambda: w.send(2))
        assert sorted(errors) == [0, 2, 3]
        assert len({str(e) for e in errors.values()}) == 1, errors
        for exc in errors.values():
            assert isinstance(exc, TransferError)
            assert (exc.rank, exc.cause, exc.round) == (1, "left", 2), exc
        assert all(e.version == 1 for e in w.workers)


# -- the blocking facade ---------------------------------------------------------------------


def _pair(address: str, job: str) -> tuple[BlockingTrainer, BlockingWorker, World]:
    plan = make_plan(DEFS, (1, 1), (1, 1))
    cfg = dataclasses.replace(CFG, job=job)
    with ThreadPoolExecutor(2) as ex:  # connect blocks until both ranks shook hands
        ft = ex.submit(BlockingTrainer.connect, address, token=TOKEN, rank=0,
                       trainer_ranks=1, world_size=2, params=[p.spec for p in plan.params],
                       config=cfg)
        fw = ex.submit(BlockingWorker.connect, address, token=TOKEN, rank=1,
                       trainer_ranks=1, world_size=2, targets=_targets(plan, 1),
                       mesh_dims=plan.params[0].dst.mesh.dims, config=cfg)
        trainer, worker = ft.result(LIMIT), fw.result(LIMIT)
    return trainer, worker, World(plan, MemoryStore(), [trainer.engine], [worker.engine])


@pytest.fixture
def pair(store_address: str, job: str) -> Iterator[tuple[BlockingTrainer, BlockingWorker,
                                                          World]]:
    trainer, worker, w = _pair(store_address, job)
    try:
        yield trainer, worker, w
    finally:
        trainer.close()
        worker.close()


def test_blocking_timeout_that_bounds_no_wait_is_refused(
        pair: tuple[BlockingTrainer, BlockingWorker, World]) -> None:
    trainer, worker, w = pair
    for value in (0, -1.0, math.nan):
        with pytest.raises(LocalProtocolError, match="timeout"):
            worker.receive(timeout=value)
        assert worker.state is EngineState.READY
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(worker.receive, timeout=math.inf)
        trainer.sync_weights(source_shards(w.plan, 0, 1))
        assert got.result(LIMIT).version == 1
    assert w.holds(1)


@pytest.mark.parametrize("closer", ["loop body", "another thread"])
def test_blocking_updates_end_when_the_worker_is_closed_between_rounds(
        pair: tuple[BlockingTrainer, BlockingWorker, World], closer: str) -> None:
    trainer, worker, w = pair
    versions: list[int] = []
    with ThreadPoolExecutor(1) as ex:
        sent = ex.submit(trainer.sync_weights, source_shards(w.plan, 0, 1))
        for u in worker.updates():
            versions.append(u.version)
            if closer == "loop body":
                worker.close()  # as the async iterator: the loop ends
            else:
                ex.submit(worker.close).result(LIMIT)  # between rounds, from another thread
        assert sent.result(LIMIT).version == 1
    assert versions == [1] and worker.state is EngineState.CLOSED
    if closer == "loop body":
        assert list(worker.updates()) == []  # a closed worker's updates() ends at once


def test_blocking_updates_left_early_then_receive_takes_the_next_round(
        pair: tuple[BlockingTrainer, BlockingWorker, World]) -> None:
    trainer, worker, w = pair
    got: list[int] = []
    with ThreadPoolExecutor(1) as ex:
        def train() -> list[int]:
            return [trainer.sync_weights(source_shards(w.plan, 0, v)).version
                    for v in (1, 2, 3)]
        sent = ex.submit(train)
        for u in worker.updates():
            got.append(u.version)
            break
        got.append(worker.receive(timeout=LIMIT).version)
        for u in worker.updates():
            got.append(u.version)
            break
        assert sent.result(LIMIT) == [1, 2, 3]
    assert got == [1, 2, 3] and w.holds(3)
    trainer.close()
    assert list(worker.updates()) == []  # the job ended: the iteration ends
    assert worker.state is EngineState.POISONED


@pytest.mark.asyncio
async def test_cancelled_in_its_target_check_once_the_round_started_fails_it_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # receive checks its targets before it waits for the start: a cancel there, with the
    # start already published, fails the round at once naming this worker, as a cancel of
    # the wait does.
    from m2n_async._engine import _targets

    far, prompt = 60, 15  # the round deadline, and the generous bound its failure is held to
    async with world() as w:
        wk = w.workers[0]
        scope = anyio.CancelScope()

        async def slow_precheck(self: Any, buckets: Any) -> None:
            await started(w, 1)
            scope.cancel()
            await anyio.sleep_forever()  # the cancel lands here, in the check

        monkeypatch.setattr(_targets.TargetCheck, "precheck", slow_precheck)
        errors: list[BaseException] = []

        async def trainer() -> None:
            try:
                await w.send(1, timeout=far)
            except TransferError as exc:
                errors.append(exc)

        with anyio.fail_after(prompt):
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer)
                with scope:
                    await wk.receive()
        assert scope.cancelled_caught
        assert wk.state is EngineState.POISONED
        [exc] = errors
        assert (exc.rank, exc.cause, exc.round) == (wk.rank, "cancelled", 1), exc
