"""Job fencing and the end of a generation, with every rank a task of one event loop.

- A second job that uses a live job's name on the same store gets ``JobClaimedError`` naming
  the holder (who, since when, which generation) and never touches the live job's rounds.
- Trainer rank 0 closing and at once connecting again (a new generation): a worker of the
  old generation sees the documented end — ``updates()`` ends, ``receive()`` raises
  ``PeerLostError`` — even when the new generation already purged the old one's keys.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import anyio
import pytest

from m2n_async import PeerLostError, TrainerEngine, WorkerEngine
from m2n_async._store import JobClaimedError, current_generation
from m2n_async.testing import MemoryStore

from ._plans import make_plan, source_shards
from .test_engine_local import CFG, DEFS, _check, _close, _connect_all, _round, _targets


@pytest.mark.asyncio
async def test_a_second_job_with_the_same_name_is_refused_naming_the_holder() -> None:
    plan = make_plan(DEFS[:2], (1, 1), (1, 1))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    specs = [p.spec for p in plan.params]
    other = dataclasses.replace(CFG, phase_timeout=0.5)
    big = make_plan(DEFS[:2], (1, 1), (1, 2))  # the second job has a rank the first lacks
    errors: dict[int, BaseException] = {}

    async def intruder(r: int) -> None:
        try:
            if r == 0:
                await TrainerEngine.connect(store=store.session(), rank=0, trainer_ranks=1,
                                            world_size=3, params=specs, config=other)
            else:
                await WorkerEngine.connect(store=store.session(), rank=r, trainer_ranks=1,
                                           world_size=3, targets=_targets(big, r),
                                           mesh_dims=(1, 2), config=other)
        except Exception as exc:
            errors[r] = exc

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for r in range(3):
                    tg.start_soon(intruder, r)
        for r in (0, 1):
            exc = errors[r]
            assert isinstance(exc, JobClaimedError) and exc.rank == r, exc
            assert exc.holder is not None and exc.holder.pid == os.getpid()
            assert exc.holder.generation == 1
            assert f"job 'm2n' rank {r} on this store is held by pid {os.getpid()}" in str(exc)
            assert "generation 1" in str(exc)
        assert 2 in errors  # its rank was free, but it found no job that would have it
        assert not isinstance(errors[2], JobClaimedError)
        # The live job never noticed: same generation, bit-exact rounds.
        assert await current_generation(store, "m2n") == 1
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 1)))
        _check(plan, workers, 1)
        assert trainers[0].generation == workers[0].generation == 1
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_reconnect_race_ends_the_old_workers_updates() -> None:
    plan = make_plan(DEFS[:2], (1, 1), (1, 1))
    store = MemoryStore()
    trainers, workers = await _connect_all(store, plan)
    old = workers[0]
    specs = [p.spec for p in plan.params]
    new: dict[str, Any] = {}
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 1)))
        await trainers[0].close()

        async def reconnect() -> None:
            new["trainer"] = await TrainerEngine.connect(
                store=store.session(), rank=0, trainer_ranks=1, world_size=2, params=specs,
                config=CFG)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reconnect)
                # The new generation exists (and purged the old one's keys, the closing
                # round start included) before the old worker asks for its next round.
                await store.get("m2n/open/2", wait=True)
                got = [r async for r in old.updates()]  # ends; raises nothing
                assert got == [] and old.version == 1
                with pytest.raises(PeerLostError, match="no more rounds"):
                    await old.receive()
                await old.close()
                new["worker"] = await WorkerEngine.connect(
                    store=store.session(), rank=1, trainer_ranks=1, world_size=2,
                    targets=_targets(plan, 1), mesh_dims=(1, 1), config=CFG)
        t, w = new["trainer"], new["worker"]
        assert t.generation == w.generation == 2
        await _round([t], [w], lambda e: e.sync_weights(source_shards(plan, 0, 2)))
        _check(plan, [w], 2)
    finally:
        await _close(*trainers, *workers, *new.values())
