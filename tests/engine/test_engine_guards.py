"""Engine guards: argument checks before a round, one round per engine at a
time, a cancel that lands while rank 0 publishes the round, a rank that fails or is
cancelled while connecting (its peers hear it at once, in the same phase's terms), and an
exception raised after the commit (the caller gets it as raised; the engine stays READY)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import anyio
import pytest

from m2n_async import (
    EnginePoisonedError,
    LocalProtocolError,
    PeerLostError,
    PreflightError,
    Store,
    TrainerEngine,
    TransferError,
    WorkerEngine,
)
from m2n_async._engine import _faults
from m2n_async.testing import Fault, InjectedFault, MemoryStore

from ._plans import make_plan, source_shards
from .test_engine_local import CFG, DEFS, _check, _close, _connect_all, _round, _targets

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"version": 3.0}, "version must be an int"),
    ({"version": True}, "version must be an int"),
    ({"timeout": math.inf}, "timeout must be a finite"),
    ({"timeout": math.nan}, "timeout must be a finite"),
    ({"timeout": -1.0}, "timeout must be a finite"),
    ({"timeout": 0}, "timeout must be a finite"),
])
async def test_bad_version_or_timeout_is_refused_before_the_round(kwargs: dict[str, Any],
                                                                  match: str) -> None:
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    try:
        with pytest.raises(LocalProtocolError, match=match):
            await trainers[0].sync_weights(source_shards(plan, 0, 1), **kwargs)
        assert trainers[0].state.value == "ready"
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 1)))
        assert trainers[0].version == workers[0].version == 1
        _check(plan, workers, 1)
    finally:
        await _close(*trainers, *workers)


async def test_second_sync_weights_while_one_runs_is_refused() -> None:
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    t = trainers[0]
    refused: list[BaseException] = []

    async def second() -> None:
        try:
            await t.sync_weights(source_shards(plan, 0, 2), version=2)
        except LocalProtocolError as exc:
            refused.append(exc)

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(workers[0].receive)
                tg.start_soon(t.sync_weights, source_shards(plan, 0, 1))
                tg.start_soon(second)  # runs while the first waits on its publish
        assert len(refused) == 1 and "already in sync_weights" in str(refused[0])
        assert t.state.value == workers[0].state.value == "ready"
        assert t.version == workers[0].version == 1
        _check(plan, workers, 1)
    finally:
        await _close(*trainers, *workers)


class _SlowReplies:
    """A store whose compare-and-set of a round start is applied at once but answered late,
    like a TCP request whose reply is still on its way when the caller is cancelled."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.applied = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes
                          ) -> tuple[bool, bytes | None]:
        out = await self._inner.compare_set(key, expected, desired)
        if key.endswith("/start"):
            self.applied.set()
            await anyio.sleep(0.2)
        return out


async def _pair(plan: Any, trainer_store: Any, worker_store: Any
                ) -> tuple[TrainerEngine, WorkerEngine]:
    """Trainer 0 and worker 1 of ``plan`` (1+1), connected over the given stores."""
    specs = [p.spec for p in plan.params]
    out: dict[int, Any] = {}

    async def trainer() -> None:
        out[0] = await TrainerEngine.connect(store=trainer_store, rank=0, trainer_ranks=1,
                                             world_size=2, params=specs, config=CFG)

    async def worker() -> None:
        out[1] = await WorkerEngine.connect(store=worker_store, rank=1, trainer_ranks=1,
                                            world_size=2, targets=_targets(plan, 1),
                                            mesh_dims=(1, 1), config=CFG)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            tg.start_soon(worker)
    return out[0], out[1]


async def test_cancel_while_rank0_publishes_aborts_the_round_everywhere() -> None:
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    store = MemoryStore()
    slow = _SlowReplies(store.session())
    t, w = await _pair(plan, slow, store.session())
    got: list[BaseException] = []

    async def receive() -> None:
        try:
            await w.receive()
        except TransferError as exc:
            got.append(exc)

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_when, slow.applied, scope)
                    await t.sync_weights(source_shards(plan, 0, 1))
        assert scope.cancelled_caught
        # The round had started: it is aborted on every rank, not left half-begun.
        assert t.state.value == "poisoned" and t.version == 0
        assert len(got) == 1 and "cancelled by its caller on rank 0" in str(got[0])
        assert w.state.value == "poisoned" and w.version == 0
    finally:
        await _close(t, w)


async def _cancel_when(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def test_cancelled_before_publishing_nothing_happens() -> None:
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    try:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await trainers[0].sync_weights(source_shards(plan, 0, 1))
        assert scope.cancelled_caught and trainers[0].state.value == "ready"
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 1)))
        assert trainers[0].version == workers[0].version == 1
    finally:
        await _close(*trainers, *workers)


class _StallInFirstCollective:
    """A store on which the first collective call stalls (before contributing) and says so:
    a rank that is slow to enter the handshake."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.stalled = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def exchange(self, key: str, *args: Any, **kw: Any) -> dict[str, bytes]:
        if "/c/" in key and not self.stalled.is_set():
            self.stalled.set()
            await anyio.sleep_forever()
        return await self._inner.exchange(key, *args, **kw)  # type: ignore[attr-defined,no-any-return]


async def _connect_pair(store: MemoryStore, worker_cfg: Any, *, cancel_worker: bool
                        ) -> tuple[dict[str, BaseException | str], dict[str, float]]:
    """Trainer 0 and worker 1 connect. With ``cancel_worker`` the worker stalls in the first
    handshake phase and its connect is cancelled there. What each raised, and when the
    trainer's outcome came (seconds after the worker's cancel or failure)."""
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    specs = [p.spec for p in plan.params]
    result: dict[str, BaseException | str] = {}
    when: dict[str, float] = {}
    worker_store = _StallInFirstCollective(store.session()) if cancel_worker else store.session()
    worker_scope = anyio.CancelScope()

    async def trainer() -> None:
        try:
            e = await TrainerEngine.connect(store=store.session(), rank=0, trainer_ranks=1,
                                            world_size=2, params=specs, config=CFG)
            result["trainer"] = "connected"
            await e.close()
        except Exception as exc:
            result["trainer"] = exc
        when["trainer"] = time.monotonic()

    async def worker() -> None:
        with worker_scope:
            try:
                e = await WorkerEngine.connect(store=worker_store,  # type: ignore[arg-type]
                                               rank=1, trainer_ranks=1, world_size=2,
                                               targets=_targets(plan, 1), mesh_dims=(1, 1),
                                               config=worker_cfg)
                result["worker"] = "connected"
                await e.close()
            except Exception as exc:
                result["worker"] = exc
        if worker_scope.cancelled_caught:
            result["worker"] = "cancelled"
        when["worker"] = time.monotonic()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)
            tg.start_soon(trainer)
            if isinstance(worker_store, _StallInFirstCollective):
                await worker_store.stalled.wait()
                worker_scope.cancel()
    return result, {"trainer": when["trainer"] - when["worker"]}


async def test_rank_cancelled_while_connecting_is_lost_to_its_peers_at_once() -> None:
    result, when = await _connect_pair(MemoryStore(), CFG, cancel_worker=True)
    assert result["worker"] == "cancelled"
    assert isinstance(result["trainer"], PeerLostError), result
    assert "rank 1" in str(result["trainer"]) and when["trainer"] < CFG.phase_timeout / 2


@pytest.mark.parametrize("chars", [100, 3000])
async def test_a_long_connect_error_is_one_text_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, chars: int) -> None:
    # The failing rank's text reaches its peers through its note, which holds 2000
    # characters: the rank raises the text cut as the note is.
    from m2n_async._data import gloo

    real = gloo.GlooTransport.connect

    async def connect(self: gloo.GlooTransport, rdv: Any) -> None:
        if self.ctx.rank == 1:
            raise RuntimeError("y" * chars)
        await real(self, rdv)

    monkeypatch.setattr(gloo.GlooTransport, "connect", connect)
    result, _ = await _connect_pair(MemoryStore(), CFG, cancel_worker=False)
    trainer, worker = result["trainer"], result["worker"]
    assert isinstance(trainer, PreflightError) and isinstance(worker, PreflightError), result
    assert str(trainer) == str(worker)
    assert "y" * min(chars, 1000) in worker.failures[1]


async def test_rank_that_cannot_connect_its_data_plane_fails_every_rank_alike() -> None:
    # An address that is no interface of this host: Gloo refuses it on the worker only,
    # after every handshake phase passed.
    bad = dataclasses.replace(CFG, host="192.0.2.1")
    result, when = await _connect_pair(MemoryStore(), bad, cancel_worker=False)
    for side in ("trainer", "worker"):
        exc = result[side]
        assert isinstance(exc, PreflightError), (side, result)
        assert exc.phase == "connected" and list(exc.failures) == [1], (side, exc)
    assert "could not connect the gloo data plane" in str(result["worker"])
    assert str(result["trainer"]) == str(result["worker"])  # one text, the failing rank's
    assert when["trainer"] < CFG.phase_timeout / 2


class _SlowOutcome:
    """A store whose write of this rank's round outcome (RoundDone, by compare-and-set) says
    so and then takes a while: a cancel can land while the outcome is being gathered."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.reporting = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def compare_set(self, key: str, *args: Any, **kw: Any) -> tuple[bool, bytes | None]:
        if "/round/" in key and "/done/" in key:
            self.reporting.set()
            await anyio.sleep(0.2)
        return await self._inner.compare_set(key, *args, **kw)  # type: ignore[no-any-return]


async def test_cancel_while_the_outcome_is_gathered_ends_the_round_like_every_rank() -> None:
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    store = MemoryStore()
    slow = _SlowOutcome(store.session())
    t, w = await _pair(plan, store.session(), slow)
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(t.sync_weights, source_shards(plan, 0, 1))
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_when, slow.reporting, scope)
                    await w.receive()
        # The worker had reported its part: the round committed here as on the trainer.
        assert t.version == w.version == 1
        assert t.state.value == w.state.value == "ready"
        _check(plan, [w], 1)
        await _round([t], [w], lambda e: e.sync_weights(source_shards(plan, 0, 2)))
        assert t.version == w.version == 2
    finally:
        await _close(t, w)


@pytest.mark.parametrize("rank", [0, 1])
async def test_a_raise_at_the_commit_point_reaches_its_caller_as_raised(rank: int) -> None:
    # The fault acts after the commit, inside the round driver's task group: the caller
    # gets InjectedFault itself (not an exception group), the version advanced on every
    # rank, and the engine, READY, takes the next round.
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    got: dict[int, Any] = {}

    async def side(e: Any) -> None:
        try:
            got[e.rank] = await (e.sync_weights(source_shards(plan, 0, 1)) if e.rank == 0
                                 else e.receive())
        except Exception as exc:
            got[e.rank] = exc

    _faults.arm([Fault("round.commit", "raise", rank=rank, round=1)])
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for e in (*trainers, *workers):
                    tg.start_soon(side, e)
        _faults.disarm()
        assert type(got[rank]) is InjectedFault, got[rank]
        assert "round.commit (rank" in str(got[rank])
        assert got[1 - rank].version == 1, got[1 - rank]
        assert trainers[0].version == workers[0].version == 1
        assert trainers[0].state.value == workers[0].state.value == "ready"
        _check(plan, workers, 1)
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 2)))
        assert trainers[0].version == workers[0].version == 2
    finally:
        _faults.disarm()
        await _close(*trainers, *workers)


@pytest.mark.parametrize("rank", [0, 1])
async def test_an_untranslated_error_in_the_outcome_poisons_the_engine(
        rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # An exception the round driver does not translate (here: from its outcome step, which
    # has none by design) leaves the round undecided on that rank: its engine must not stay
    # UPDATING, as if a round were still running, but refuse further rounds as POISONED.
    from m2n_async._engine._round import RoundDriver

    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    outcome = RoundDriver._outcome

    async def broken(self: Any, *a: Any, **kw: Any) -> Any:
        if self.rank == rank:
            raise RuntimeError("outcome step broke")
        return await outcome(self, *a, **kw)

    monkeypatch.setattr(RoundDriver, "_outcome", broken)
    got: dict[int, Any] = {}

    async def side(e: Any) -> None:
        try:
            got[e.rank] = await (e.sync_weights(source_shards(plan, 0, 1), timeout=2)
                                 if e.rank == 0 else e.receive())
        except Exception as exc:
            got[e.rank] = exc

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for e in (*trainers, *workers):
                    tg.start_soon(side, e)
        broke = (*trainers, *workers)[rank]
        assert type(got[rank]) is RuntimeError, got[rank]
        assert broke.state.value == "poisoned", broke.state
        with pytest.raises(EnginePoisonedError, match="outcome step broke"):
            await (broke.sync_weights(source_shards(plan, 0, 2)) if rank == 0
                   else broke.receive(timeout=1))
    finally:
        await _close(*trainers, *workers)
