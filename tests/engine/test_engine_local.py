"""Engines end to end with every rank as a task of one event loop over a ``MemoryStore``.

Fast (no process spawn): lifecycle, versions, load callbacks, lazy sources, cancellation.
The data plane is still real Gloo (one process group per rank, all in this process).
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import pytest
import torch

from m2n_async import (
    EngineConfig,
    EnginePoisonedError,
    LoadTarget,
    LocalProtocolError,
    PeerLostError,
    TrainerEngine,
    TransferError,
    WorkerEngine,
)
from m2n_async._engine._round import RoundDriver
from m2n_async._proto.plan import TransferPlan
from m2n_async.testing import MemoryStore

from ._plans import ParamDef, R, empty_targets, expected_shards, make_plan, source_shards

CFG = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=20,
                   round_timeout=20, abort_grace=2, host="127.0.0.1")

DEFS: list[ParamDef] = [
    ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),
    ("w_col", (12, 6), torch.bfloat16, (R, 1), (R, 0)),
    ("rep", (6, 4), torch.float16, None, (R, 0)),
    ("experts", (4, 6, 6), torch.float32, (R, 0), (R, 2)),
]


def _targets(plan: TransferPlan, rank: int) -> dict[str, Any]:
    return {p.spec.name: (t, p.dst.placements)
            for (name, t), p in zip(empty_targets(plan, rank).items(), plan.params,
                                    strict=True)}


async def _connect_all(store: MemoryStore, plan: TransferPlan, cfg: EngineConfig = CFG,
                       targets: dict[int, dict[str, Any]] | None = None
                       ) -> tuple[list[TrainerEngine], list[WorkerEngine]]:
    t, w = plan.trainer_ranks, plan.world_size
    specs = [p.spec for p in plan.params]
    dims = plan.params[0].dst.mesh.dims
    out: dict[int, Any] = {}
    tg_targets = targets or {r: _targets(plan, r) for r in range(t, w)}

    async def one(r: int) -> None:
        sess = store.session()
        if r < t:
            out[r] = await TrainerEngine.connect(store=sess, rank=r, trainer_ranks=t,
                                                 world_size=w, params=specs, config=cfg)
        else:
            out[r] = await WorkerEngine.connect(store=sess, rank=r, trainer_ranks=t,
                                                world_size=w, targets=tg_targets[r],
                                                mesh_dims=dims, config=cfg)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for r in range(w):
                tg.start_soon(one, r)
    return [out[r] for r in range(t)], [out[r] for r in range(t, w)]


async def _round(trainers: Sequence[TrainerEngine], workers: Sequence[WorkerEngine],
                 send: Callable[[TrainerEngine], Awaitable[Any]]) -> list[Any]:
    results: dict[int, Any] = {}

    async def tr(e: TrainerEngine) -> None:
        results[e.rank] = await send(e)

    async def wk(e: WorkerEngine) -> None:
        results[e.rank] = await e.receive()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for e in trainers:
                tg.start_soon(tr, e)
            for e in workers:
                tg.start_soon(wk, e)
    return [results[r] for r in sorted(results)]


async def _close(*engines: Any) -> None:
    for e in engines:
        await e.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (NaN payloads included, which == would not)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def _check(plan: TransferPlan, workers: Sequence[WorkerEngine], version: int,
           skip: Sequence[str] = ()) -> None:
    for e in workers:
        for name, want in expected_shards(plan, e.rank, version).items():
            if name not in skip:
                assert _same(e._sinks[name].tensor, want), (e.rank, name)


@pytest.mark.asyncio
async def test_rounds_versions_and_lifecycle() -> None:
    plan = make_plan(DEFS, (1, 2), (1, 2))
    store = MemoryStore()
    cfg = EngineConfig(**{**CFG.__dict__, "link_bytes_per_second": 1e9})
    trainers, workers = await _connect_all(store, plan, cfg)
    try:
        assert all(e.state.value == "ready" and e.transport == "gloo"
                   for e in [*trainers, *workers])
        for v in (1, 2, 5):
            seen: list[tuple[int, int]] = []
            res = await _round(trainers, workers, lambda e, v=v, seen=seen: e.sync_weights(
                source_shards(plan, e.rank, v), version=v if e.rank == 0 else None,
                progress=(lambda done, total: seen.append((done, total))) if e.rank == 0
                else None))
            assert seen and seen[-1] == (plan.send_bytes(0), plan.send_bytes(0))
            assert [d for d, _ in seen] == sorted(d for d, _ in seen)
            assert res[0].lower_bound_seconds == plan.lower_bound_seconds(1e9)
            assert res[0].efficiency is not None and res[0].efficiency > 0
            _check(plan, workers, v)
            assert {r.version for r in res} == {v}
            assert {e.last_began for e in [*trainers, *workers]} == {res[0].round}
            assert [r.bytes for r in res[:2]] == [plan.send_bytes(0), plan.send_bytes(1)]
            assert res[2].bytes == plan.recv_bytes(2) > 0
            assert all(r.peak_extra_bytes <= CFG.max_inflight * 4096 for r in res)
            assert {"pack", "transfer", "unpack", "pipeline", "commit"} <= set(res[2].phases)
        with pytest.raises(LocalProtocolError, match="does not advance"):
            await trainers[0].sync_weights({}, version=5)
        assert trainers[0].state.value == "ready"  # refused before anything happened
    finally:
        await _close(*trainers, *workers)
    assert all(e.state.value == "closed" for e in [*trainers, *workers])
    with pytest.raises(LocalProtocolError, match="CLOSED"):
        await workers[0].receive()


@pytest.mark.asyncio
async def test_load_callbacks_lazy_sources_and_updates() -> None:
    plan = make_plan(DEFS, (1, 1), (1, 2))
    store = MemoryStore()
    got: dict[int, dict[str, torch.Tensor]] = {1: {}, 2: {}}
    targets = {}
    for r in (1, 2):
        tg = _targets(plan, r)
        p = plan.params[3]  # experts through a callback
        shape = p.dst.local_shape(p.spec.shape, r)
        tg["experts"] = LoadTarget(shape, torch.float32, p.dst.placements,
                                   lambda n, t, r=r: got[r].__setitem__(n, t.clone()))
        targets[r] = tg
    trainers, workers = await _connect_all(store, plan, targets=targets)
    results: list[Any] = []

    async def consume(e: WorkerEngine) -> None:
        async for res in e.updates():
            results.append(res.version)

    try:
        async with anyio.create_task_group() as tg:
            for e in workers:
                tg.start_soon(consume, e)
            tr = trainers[0]
            shards = source_shards(plan, 0, 1)
            # a callable source, called once per bucket with that bucket's names
            await tr.sync_weights(lambda names: {n: shards[n] for n in names})
            for e in workers:
                assert _same(got[e.rank]["experts"],
                             expected_shards(plan, e.rank, 1)["experts"])
            _check(plan, workers, 1, skip=["experts"])
            # an iterator of (name, tensor) pairs, consumed lazily
            await tr.sync_weights(iter(source_shards(plan, 0, 2).items()))
            _check(plan, workers, 2, skip=["experts"])
            for e in workers:
                assert _same(got[e.rank]["experts"],
                             expected_shards(plan, e.rank, 2)["experts"])
            await tr.close()  # ends the workers' updates() loops
        assert sorted(results) == [1, 1, 2, 2]
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_bad_source_fails_every_rank_identically() -> None:
    plan = make_plan(DEFS, (1, 2), (1, 1))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    errors: dict[int, BaseException] = {}

    async def send(e: TrainerEngine) -> None:
        shards = source_shards(plan, e.rank, 1)
        if e.rank == 1:
            # Wrong dtype on one trainer (int: not a float cast), from a lazy source, so it
            # is found when its bucket is staged, inside the round.
            shards["rep"] = shards["rep"].to(torch.int16)
            await e.sync_weights(lambda names: {n: shards[n] for n in names})
            return
        await e.sync_weights(shards)

    async def guard(r: int, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await fn()
        except Exception as exc:
            errors[r] = exc

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for e in trainers:
                    tg.start_soon(guard, e.rank, lambda e=e: send(e))
                for w in workers:
                    tg.start_soon(guard, w.rank, w.receive)
        assert sorted(errors) == [0, 1, 2]
        msgs = {str(e) for e in errors.values()}
        assert len(msgs) == 1, msgs
        err = errors[0]
        assert isinstance(err, TransferError) and err.rank == 1 and err.round == 1
        assert "'rep'" in str(err) and "int16" in str(err) and "float16" in str(err)
        # Found inside the round: every rank's part of it had begun (it may have written).
        assert {e.last_began for e in [*trainers, *workers]} == {err.round}
        for e in [*trainers, *workers]:
            assert e.state.value == "poisoned" and e.version == 0
            with pytest.raises(EnginePoisonedError) as info:
                await (e.sync_weights({}) if isinstance(e, TrainerEngine) else e.receive())
            assert info.value.__cause__ is not None
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_cancelled_receive_before_and_during_a_round() -> None:
    plan = make_plan(DEFS[:2], (1, 1), (1, 1))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    try:
        # Waiting for a round that never starts: cancelling is harmless.
        with anyio.move_on_after(0.2):
            await workers[0].receive()
        assert workers[0].state.value == "ready"
        with pytest.raises(TimeoutError, match="no round 1 started"):
            await workers[0].receive(timeout=0.1)
        assert workers[0].state.value == "ready"

        # Cancel the trainer mid-round (its lazy source blocks): the worker fails fast.
        started = anyio.Event()

        def slow(names: list[str]) -> dict[str, torch.Tensor]:
            anyio.from_thread.run_sync(started.set)
            import time
            time.sleep(1.0)
            return {n: source_shards(plan, 0, 1)[n] for n in names}

        worker_error: list[BaseException] = []

        async def wk() -> None:
            try:
                await workers[0].receive()
            except Exception as exc:
                worker_error.append(exc)

        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(wk)
            with anyio.CancelScope() as scope:
                async def cancel_soon() -> None:
                    await started.wait()
                    scope.cancel()
                tg.start_soon(cancel_soon)
                await trainers[0].sync_weights(slow)
        assert scope.cancelled_caught
        assert anyio.current_time() - t0 < 10  # far below the 20 s round deadline
        assert trainers[0].state.value == "poisoned"
        assert isinstance(worker_error[0], TransferError)
        assert "cancelled by its caller on rank 0" in str(worker_error[0])
        assert (worker_error[0].rank, worker_error[0].cause) == (0, "cancelled")
        assert workers[0].version == 0
    finally:
        await _close(*trainers, *workers)


async def _everyone(trainers: Sequence[TrainerEngine], workers: Sequence[WorkerEngine],
                    send: Callable[[TrainerEngine], Awaitable[Any]], limit: float = 30
                    ) -> tuple[dict[int, BaseException], float]:
    """Run one round on every rank; collect each rank's exception and the elapsed time."""
    errors: dict[int, BaseException] = {}

    async def guard(r: int, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await fn()
        except Exception as exc:
            errors[r] = exc

    t0 = anyio.current_time()
    with anyio.fail_after(limit):
        async with anyio.create_task_group() as tg:
            for e in trainers:
                tg.start_soon(guard, e.rank, lambda e=e: send(e))
            for w in workers:
                tg.start_soon(guard, w.rank, w.receive)
    return errors, anyio.current_time() - t0


@pytest.mark.asyncio
async def test_round_deadline_aborts_everywhere() -> None:
    """A trainer whose source hangs: the round deadline fires, every rank raises the same
    TransferError well before the hung source would return."""
    plan = make_plan(DEFS[:2], (1, 1), (1, 2))
    cfg = EngineConfig(transport="gloo", bucket_bytes=512, phase_timeout=20, round_timeout=1.0,
                       abort_grace=2, host="127.0.0.1")
    trainers, workers = await _connect_all(MemoryStore(), plan, cfg)

    def hung(names: list[str]) -> dict[str, torch.Tensor]:
        import time
        time.sleep(8)
        return {}

    try:
        errors, elapsed = await _everyone(trainers, workers, lambda e: e.sync_weights(hung))
        assert sorted(errors) == [0, 1, 2]
        assert len({str(e) for e in errors.values()}) == 1
        assert all(isinstance(e, TransferError) for e in errors.values())
        assert "deadline" in str(errors[0])
        # The hung trainer is named (the workers were waiting on it), by every rank.
        assert all((e.rank, e.cause) == (0, "deadline") for e in errors.values()), errors
        assert elapsed < 1.0 + 2 * cfg.abort_grace + 2
        assert all(e.version == 0 and e.state.value == "poisoned" for e in [*trainers, *workers])
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_load_callback_error_fails_the_round() -> None:
    plan = make_plan(DEFS[:2], (1, 1), (1, 1))
    targets = {1: _targets(plan, 1)}
    p = plan.params[1]

    def broken(name: str, t: torch.Tensor) -> None:
        raise ValueError("quantizer exploded")

    targets[1]["w_col"] = LoadTarget(p.dst.local_shape(p.spec.shape, 1), torch.bfloat16,
                                     p.dst.placements, broken)
    trainers, workers = await _connect_all(MemoryStore(), plan, targets=targets)
    waits: list[float] = []  # how long each rank looked for a peer's cause of its failure
    find_cause = RoundDriver._find_cause

    async def recorded(self: RoundDriver, core: Any, *, within: float) -> Any:
        waits.append(within)
        return await find_cause(self, core, within=within)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RoundDriver, "_find_cause", recorded)
            errors, _ = await _everyone(trainers, workers, lambda e: e.sync_weights(
                source_shards(plan, 0, 1)))
        # The callback's error is the worker's own: it records it at once, no peer's looked for
        assert not any(waits), waits
        assert sorted(errors) == [0, 1] and str(errors[0]) == str(errors[1])
        assert isinstance(errors[0], TransferError)
        assert errors[0].rank == 1 and "quantizer exploded" in str(errors[0])
        assert "'w_col'" in str(errors[0])
        with pytest.raises(EnginePoisonedError) as info:
            await workers[0].receive()
        assert info.value.__cause__ is errors[1]
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_concurrent_receive_is_a_local_protocol_error() -> None:
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    w = workers[0]
    try:
        started = anyio.Event()
        release = anyio.Event()

        def slow(names: list[str]) -> dict[str, torch.Tensor]:
            anyio.from_thread.run_sync(started.set)
            anyio.from_thread.run(release.wait)
            return source_shards(plan, 0, 1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(w.receive)
            tg.start_soon(trainers[0].sync_weights, slow)
            await started.wait()
            with anyio.fail_after(10):
                while w.state.value != "updating":  # noqa: ASYNC110 - polling engine state
                    await anyio.sleep(0.01)
            with pytest.raises(LocalProtocolError, match="UPDATING"):
                await w.receive()
            release.set()
        assert w.state.value == "ready" and w.version == 1
        _check(plan, workers, 1)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_wrong_target_fails_preflight_everywhere() -> None:
    from m2n_async import PreflightError

    plan = make_plan(DEFS[:2], (1, 1), (1, 1))
    targets = {1: _targets(plan, 1)}
    targets[1]["w_row"] = (torch.zeros(3, 3), targets[1]["w_row"][1])
    errors: dict[int, BaseException] = {}
    store = MemoryStore()

    async def one(r: int) -> None:
        try:
            if r == 0:
                await TrainerEngine.connect(store=store.session(), rank=0, trainer_ranks=1,
                                            world_size=2, params=[p.spec for p in plan.params],
                                            config=CFG)
            else:
                await WorkerEngine.connect(store=store.session(), rank=1, trainer_ranks=1,
                                           world_size=2, targets=targets[1], config=CFG)
        except Exception as exc:
            errors[r] = exc

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, PreflightError) for e in errors.values())
    assert str(errors[0]) == str(errors[1])
    assert "runtime_ready" in str(errors[0]) and "'w_row'" in str(errors[0])


@pytest.mark.asyncio
async def test_module_source_to_module_targets() -> None:
    """sync_weights(nn.Module) on the trainer; targets_from_module (column/row TP) on 2
    workers: the worker modules end up equal to the trainer's slices."""
    from m2n_async import specs_from_module, targets_from_module

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Linear(12, 6))
    specs = specs_from_module(src)
    store = MemoryStore()
    tp = {"0": "colwise", "1": "rowwise"}
    dst_modules = {r: torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
                   for r in (1, 2)}
    engines: dict[int, Any] = {}

    async def one(r: int) -> None:
        if r == 0:
            engines[r] = await TrainerEngine.connect(store=store.session(), rank=0,
                                                     trainer_ranks=1, world_size=3,
                                                     params=specs, config=CFG)
        else:
            m = dst_modules[r]
            with torch.no_grad():  # local TP shapes: colwise 12->6 rows, rowwise 12->6 cols
                m[0].weight = torch.nn.Parameter(torch.zeros(6, 6))
                m[0].bias = torch.nn.Parameter(torch.zeros(6))
                m[1].weight = torch.nn.Parameter(torch.zeros(6, 6))
            targets = targets_from_module(m, tp)
            engines[r] = await WorkerEngine.connect(store=store.session(), rank=r,
                                                    trainer_ranks=1, world_size=3,
                                                    targets=targets, mesh_dims=(1, 2),
                                                    config=CFG)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for r in range(3):
                tg.start_soon(one, r)
    try:
        trainer, workers = engines[0], [engines[1], engines[2]]
        await _round([trainer], workers, lambda e: e.sync_weights(src))
        for k, r in enumerate((1, 2)):
            m = dst_modules[r]
            rows = slice(6 * k, 6 * k + 6)
            assert torch.equal(m[0].weight, src[0].weight[rows])
            assert torch.equal(m[0].bias, src[0].bias[rows])
            assert torch.equal(m[1].weight, src[1].weight[:, rows])
            assert torch.equal(m[1].bias, src[1].bias)
    finally:
        await _close(*engines.values())


def test_split_buckets_is_a_pure_partition() -> None:
    from m2n_async._engine._engine import split_buckets

    plan = make_plan([(f"p{i}", (6,), torch.float32, (R, 0), None) for i in range(7)],
                     (1, 2), (1, 1))
    whole = plan.buckets(1 << 20)
    assert len(whole) == 1
    parts = split_buckets(plan, whole, 3)
    assert [(b.index, b.start, b.stop) for b in parts] == [(0, 0, 3), (1, 3, 6), (2, 6, 7)]
    assert sum(b.nbytes for b in parts) == whole[0].nbytes
    assert split_buckets(plan, whole, 100) == whole
    # Parameters of several sizes: each part's bytes are its own parameters' costs.
    plan = make_plan([(f"q{i}", (2 * (i % 3 + 1),), torch.float32, (R, 0), None)
                      for i in range(7)], (1, 2), (1, 1))
    assert plan.param_costs() == [plan.param_cost(i) for i in range(7)]
    parts = split_buckets(plan, plan.buckets(1 << 20), 3)
    assert [b.nbytes for b in parts] == [
        sum(plan.param_cost(i) for i in range(b.start, b.stop)) for b in parts]
    assert len(set(b.nbytes for b in parts)) > 1  # the sizes differ between parts


@pytest.mark.asyncio
async def test_many_small_params_split_into_overlapping_buckets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import m2n_async._engine._engine as eng

    monkeypatch.setattr(eng, "MAX_BUCKET_PARAMS", 2)
    defs: list[ParamDef] = [(f"b{i}", (6,), torch.float32, (R, 0), None) for i in range(5)]
    plan = make_plan(defs, (1, 2), (1, 2))
    cfg = EngineConfig(**{**CFG.__dict__, "bucket_bytes": 8 << 20})
    trainers, workers = await _connect_all(MemoryStore(), plan, cfg)
    try:
        res = await _round(trainers, workers,
                           lambda e: e.sync_weights(source_shards(plan, e.rank, 1)))
        assert {r.buckets for r in res} == {3}
        _check(plan, workers, 1)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_worker_waiting_for_a_round_names_the_lost_rank() -> None:
    # The store's own error names only a key; the engine says which rank (and role) died, in
    # the round's TransferError, as the ranks in the round would.
    plan = make_plan(DEFS[:1], (1, 2), (1, 2))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    errors: dict[int, BaseException] = {}

    async def wait(e: WorkerEngine) -> None:
        try:
            await e.receive(timeout=20)
        except TransferError as exc:
            errors[e.rank] = exc

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for e in workers:
                    tg.start_soon(wait, e)
                await anyio.sleep(0.05)
                await trainers[0]._store.aclose()  # the trainer's process "died"
        assert sorted(errors) == [e.rank for e in workers]
        assert len({str(e) for e in errors.values()}) == 1
        for exc in errors.values():
            assert isinstance(exc, TransferError) and exc.rank == 0, exc
            assert exc.cause == "lost" and exc.round == 1, exc
            assert "rank 0 (trainer) was lost" in str(exc)
        # The other trainer, entering the round, fails alike at once.
        with anyio.fail_after(5):
            with pytest.raises(TransferError) as info:
                await trainers[1].sync_weights(source_shards(plan, 1, 1))
        assert str(info.value) == str(errors[2]) and info.value.rank == 0
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_worker_arenas_sized_for_what_is_staged() -> None:
    # Aligned layouts: every message lands in place except those of a load-callback target,
    # which is fed from staging. The workers' receive arenas must hold just that — they
    # used to be sized for the whole bucket (3 x 63 MiB for 80 KB on the CPU bench's model).
    defs: list[ParamDef] = [
        # halves of 1 MiB: large enough to move zero-copy (DIRECT_MIN_BYTES)
        ("a", (1024, 512), torch.float32, (R, 0), (R, 0)),
        ("b", (512, 2048), torch.bfloat16, (R, 1), (R, 1)),
        ("cb", (16, 8), torch.float32, (R, 0), (R, 0)),
    ]
    plan = make_plan(defs, (1, 2), (1, 2))
    got: dict[int, torch.Tensor] = {}
    targets = {}
    for r in (2, 3):
        tg = _targets(plan, r)
        p = plan.params[2]
        tg["cb"] = LoadTarget(p.dst.local_shape(p.spec.shape, r), torch.float32,
                              p.dst.placements, lambda n, t, r=r: got.__setitem__(r, t.clone()))
        targets[r] = tg
    cfg = EngineConfig(**{**CFG.__dict__, "bucket_bytes": 8 << 20})
    trainers, workers = await _connect_all(MemoryStore(), plan, cfg, targets=targets)
    try:
        res = await _round(trainers, workers, lambda e: e.sync_weights(
            source_shards(plan, e.rank, 1)))
        _check(plan, workers, 1, skip=["cb"])
        for e in workers:
            cb_bytes = 8 * 8 * 4  # this worker's half of "cb" (16 x 8 float32, dim 0 split)
            assert _same(got[e.rank], expected_shards(plan, e.rank, 1)["cb"])
            transport = e._transport
            assert transport is not None and transport._arenas is not None
            assert transport._arenas.size == cb_bytes, transport._arenas.size
            assert res[e.rank].peak_extra_bytes == cb_bytes
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_worker_lost_between_rounds_fails_the_next_round_alike_everywhere() -> None:
    # One class on every rank: the worker waiting for round 2 and the trainer that starts it
    # raise the same TransferError naming the lost worker (the waiting one used to get
    # PeerLostError at once and the trainer a TransferError seconds later).
    plan = make_plan(DEFS[:2], (1, 1), (1, 2))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 1)))
        await workers[1]._store.aclose()  # worker 2's process "died" between rounds
        errors, elapsed = await _everyone(trainers, workers[:1],
                                          lambda e: e.sync_weights(source_shards(plan, 0, 2)),
                                          limit=10)
        assert sorted(errors) == [0, 1] and elapsed < 5
        assert str(errors[0]) == str(errors[1])
        for e in errors.values():
            assert isinstance(e, TransferError) and (e.rank, e.cause, e.round) == (2, "lost", 2)
        assert trainers[0].version == workers[0].version == 1
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_round_deadline_names_the_rank_waited_on() -> None:
    # The worker never calls receive(): the trainer's 32 MiB send cannot complete (far more
    # than loopback socket buffers hold), the round deadline fires, and the error names the
    # worker that did not report (and that the trainer was still waiting on), not the rank
    # whose deadline fired.
    defs: list[ParamDef] = [("big", (4096, 2048), torch.float32, None, None)]
    plan = make_plan(defs, (1, 1), (1, 1))
    cfg = EngineConfig(transport="gloo", bucket_bytes=64 << 20, phase_timeout=20,
                       round_timeout=2.0, abort_grace=1, host="127.0.0.1")
    trainers, workers = await _connect_all(MemoryStore(), plan, cfg)
    try:
        with anyio.fail_after(30):
            with pytest.raises(TransferError) as info:
                await trainers[0].sync_weights(source_shards(plan, 0, 1))
        msg = str(info.value)
        assert info.value.rank == 1 and info.value.cause == "deadline", msg
        assert "did not report its part of round 1" in msg, msg
        assert "round deadline of 2 s" in msg and "rank(s) [0] were waiting on it" in msg, msg
        assert workers[0]._transport is not None and workers[0]._transport.waiting_on() == []
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_rank_that_reported_then_died_does_not_fail_the_round() -> None:
    # Worker 1 reports the round done and then its process dies (its store session ends)
    # while worker 2 is still unpacking. The others must keep gathering outcomes rather than
    # report worker 1 "lost before reporting": it did report, and the round succeeded.
    from m2n_async._proto.round import RoundKeys as _RoundKeys

    plan = make_plan(DEFS[:1], (1, 1), (1, 2))
    slow_rank = 2
    targets = {r: _targets(plan, r) for r in (1, 2)}
    p = plan.params[0]

    def slow_load(name: str, t: torch.Tensor) -> None:
        import time
        time.sleep(1.0)  # on the unpack thread: worker 2 finishes well after worker 1
        got[name] = t.clone()

    got: dict[str, torch.Tensor] = {}
    targets[slow_rank][p.spec.name] = LoadTarget(p.dst.local_shape(p.spec.shape, slow_rank),
                                                 torch.float32, p.dst.placements, slow_load)
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan, targets=targets)
    results: dict[int, Any] = {}

    async def run(e: Any) -> None:
        try:
            if e.rank == 0:
                results[0] = await e.sync_weights(source_shards(plan, 0, 1))
            else:
                results[e.rank] = await e.receive()
        except Exception as exc:
            results[e.rank] = exc

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for e in [*trainers, *workers]:
                    tg.start_soon(run, e)
                done_key = _RoundKeys(workers[0]._namespace, 1).done(1)
                await store.get(done_key, wait=True)
                await workers[0]._store.aclose()  # worker 1 "dies" after reporting
        assert not isinstance(results[0], Exception), results
        assert results[slow_rank].version == 1, results[slow_rank]
        want = expected_shards(plan, slow_rank, 1)[p.spec.name]
        assert _same(got[p.spec.name], want)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_last_began_says_a_failed_receive_never_began_its_round() -> None:
    # The trainers close the job between rounds: the worker's next receive fails before
    # its part of round 2 began (last_began stays 1), so it wrote nothing of it.
    plan = make_plan(DEFS[:2], (1, 1), (1, 1))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, e.rank, 1)))
        await _close(*trainers)
        with anyio.fail_after(30), pytest.raises(PeerLostError):
            await workers[0].receive()
        assert workers[0].last_began == 1
        _check(plan, workers, 1)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_checked_sources_serve_the_round_and_are_dropped_after_it() -> None:
    """A plain dict checked before the round reaches the lane as ``CheckedSources`` (each
    shard by plan index); the transport holds it during the pipeline only, after a round
    that failed too, so the caller's shards are not kept alive by the engine."""
    import gc
    import weakref

    from m2n_async._data._transport import Transport

    plan = make_plan(DEFS, (1, 2), (1, 2))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    handed: dict[int, Any] = {}
    real = Transport.use_checked

    def spying(self: Transport, checked: Any) -> None:
        if checked is not None:
            handed[self.ctx.rank] = checked
        real(self, checked)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Transport, "use_checked", spying)
            shards = {e.rank: source_shards(plan, e.rank, 1) for e in trainers}
            await _round(trainers, workers, lambda e: e.sync_weights(shards[e.rank]))
        _check(plan, workers, 1)
        assert sorted(handed) == [0, 1]
        names = [p.spec.name for p in plan.params]
        for r, c in handed.items():
            assert c.mapping is shards[r]
            assert all(map(operator.is_, c.tensors, (shards[r][n] for n in names)))
            assert list(c.dtypes) == [shards[r][n].dtype for n in names]
        del c
        handed.clear()
        assert all(e._transport is not None and e._transport._checked is None
                   for e in trainers)
        refs = [weakref.ref(t) for s in shards.values() for t in s.values()]
        shards.clear()
        gc.collect()
        assert all(r() is None for r in refs)

        failed: list[BaseException] = []

        async def send(e: TrainerEngine) -> None:  # a round that fails in the pipeline
            bad = source_shards(plan, e.rank, 2)
            try:
                if e.rank == 1:
                    bad["rep"] = bad["rep"].to(torch.int16)
                    await e.sync_weights(lambda names: {n: bad[n] for n in names})
                else:
                    await e.sync_weights(bad)
            except TransferError as exc:
                failed.append(exc)

        async def recv(w: WorkerEngine) -> None:
            with pytest.raises(TransferError):
                await w.receive()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for e in trainers:
                    tg.start_soon(send, e)
                for w in workers:
                    tg.start_soon(recv, w)
        assert len(failed) == 2
        assert all(e._transport is not None and e._transport._checked is None
                   for e in trainers)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_peer_whose_liveness_key_goes_after_its_connections_is_found_leaving() -> None:
    """A rank that leaves closes its data plane before its liveness key goes, so a peer's
    send may fail first, naming nobody. While that peer waits for a cause, it keeps
    looking for leavers: the key gone 0.3 s later makes the failure the leaver's."""
    plan = make_plan(DEFS, (1, 2), (1, 1))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    try:
        rounds = trainers[0]._rounds
        assert rounds is not None
        leaver = workers[0].rank
        core = rounds.core(trainers[0]._round + 1)

        async def leave_late() -> None:
            await anyio.sleep(0.3)
            await store.session().delete(rounds.group.alive_key(leaver))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(leave_late)
                cause = await rounds._find_cause(core, within=1.0)
        assert cause is not None and cause.rank == leaver, cause
        assert "left the job" in core.error(cause).args[0], core.error(cause)
    finally:
        await _close(*trainers, *workers)
