"""What the call-API matrices (``test_sync_matrix``, ``test_receive_matrix``) share: a world
of engines over one ``MemoryStore`` (real Gloo underneath), its reference rounds, and bounded
waits for what another task drives."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from m2n_async import EngineConfig, TrainerEngine, WorkerEngine
from m2n_async._proto.plan import TransferPlan
from m2n_async.testing import MemoryStore

from ._plans import ParamDef, R, empty_targets, expected_shards, make_plan, source_shards

CFG = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=20,
                   round_timeout=20, abort_grace=2, host="127.0.0.1")
DEFS: list[ParamDef] = [("w", (8, 6), torch.float32, (R, 0), (R, 1))]
#: the bound of every wait in these files: a hang fails the test instead of blocking the run
LIMIT = 20


def _targets(plan: TransferPlan, rank: int) -> dict[str, Any]:
    return {p.spec.name: (t, p.dst.placements)
            for t, p in zip(empty_targets(plan, rank).values(), plan.params, strict=True)}


@dataclasses.dataclass
class World:
    plan: TransferPlan
    store: MemoryStore
    trainers: list[TrainerEngine]
    workers: list[WorkerEngine]

    def shards(self, v: int, rank: int = 0) -> dict[str, torch.Tensor]:
        """Trainer ``rank``'s reference shards of version ``v``."""
        return source_shards(self.plan, rank, v)

    def send(self, v: int, rank: int = 0, **kw: Any) -> Any:
        """Trainer ``rank``'s ``sync_weights`` of the reference weights of version ``v``."""
        return self.trainers[rank].sync_weights(self.shards(v, rank), **kw)

    def holds(self, version: int) -> bool:
        """Whether every worker's targets hold the reference weights of ``version``, bit for
        bit (random bytes include NaNs, which == would not match)."""
        return all(torch.equal(w._sinks[n].tensor.view(torch.uint8), want.view(torch.uint8))
                   for w in self.workers
                   for n, want in expected_shards(self.plan, w.rank, version).items())

    def receive_all(self, tg: TaskGroup, out: dict[int, Any]) -> None:
        """Start every worker's ``receive`` in ``tg``; each one's result or error into ``out``."""
        for wk in self.workers:
            tg.start_soon(_outcome, wk.receive, wk.rank, out)


async def _outcome(call: Callable[[], Any], key: int, out: dict[int, Any]) -> None:
    try:
        out[key] = await call()
    except Exception as exc:  # the result or the error, for the test to compare
        out[key] = exc


@asynccontextmanager
async def world(trainers: int = 1, workers: int = 1,
                defs: Sequence[ParamDef] = DEFS) -> AsyncIterator[World]:
    plan = make_plan(defs, (1, trainers), (1, workers))
    store = MemoryStore()
    t, n = plan.trainer_ranks, plan.world_size
    dims = plan.params[0].dst.mesh.dims
    out: dict[int, Any] = {}

    async def one(r: int) -> None:
        if r < t:
            out[r] = await TrainerEngine.connect(store=store.session(), rank=r,
                                                 trainer_ranks=t, world_size=n,
                                                 params=[p.spec for p in plan.params],
                                                 config=CFG)
        else:
            out[r] = await WorkerEngine.connect(store=store.session(), rank=r,
                                                trainer_ranks=t, world_size=n,
                                                targets=_targets(plan, r), mesh_dims=dims,
                                                config=CFG)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            for r in range(n):
                tg.start_soon(one, r)
    w = World(plan, store, [out[r] for r in range(t)], [out[r] for r in range(t, n)])
    try:
        yield w
    finally:
        with anyio.fail_after(LIMIT):
            for e in [*w.trainers, *w.workers]:
                await e.close()


async def until(pred: Callable[[], bool]) -> None:
    """Wait (bounded) until ``pred()`` holds: an engine reached a state another task drives."""
    with anyio.fail_after(LIMIT):
        while not pred():  # noqa: ASYNC110 - polling engine state another task drives
            await anyio.sleep(0.005)


async def started(w: World, k: int) -> None:
    """Wait (bounded) until trainer rank 0 has published round ``k``."""
    key = w.workers[0]._rounds.core(k).keys.start  # type: ignore[union-attr]
    with anyio.fail_after(LIMIT):
        await w.store.get(key, wait=True)


def waiting(e: TrainerEngine | WorkerEngine) -> bool:
    """``e`` is in a call waiting for its round to start."""
    return e._start_wait is not None
