"""Rank functions the toolkit's tests run in a ``LocalWorld`` (not a test module).

A toy model of two parameters: trainers hold row shards (an FSDP-like layout on a (T, 1)
mesh), workers a (1, N) tensor-parallel layout; every round's content is a function of the
version, so a worker checks its shard bit-exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from m2n_async import REPLICATE, Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine
from m2n_async.testing import RankContext

R = REPLICATE
SHAPES = {"embed": (8, 4), "proj": (6, 4)}
WORKER_PLACEMENTS = {"embed": (R, 0), "proj": (R, 1)}


def full(name: str, version: int) -> torch.Tensor:
    shape = SHAPES[name]
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
            + 1000.0 * version)


def _slice(t: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    box = layout.box(tuple(t.shape), rank)
    return t[tuple(slice(lo, hi) for lo, hi in box)].contiguous()


async def toy_rank(ctx: RankContext, *, rounds: int = 1, config: dict[str, Any] | None = None,
                   ) -> dict[str, Any]:
    """Connect, move ``rounds`` versions, check them; return what was committed."""
    cfg = ctx.config(bucket_bytes=64, **(config or {}))  # one bucket per parameter
    t, n = ctx.trainer_ranks, ctx.world_size - ctx.trainer_ranks
    if ctx.is_trainer:
        src = Layout(Mesh((t, 1), 0), (0, R))
        specs = [ParamSpec(name, torch.float32, shape, src) for name, shape in SHAPES.items()]
        async with await TrainerEngine.connect(**ctx.connect_kwargs, params=specs,
                                               config=cfg, timeout=30) as engine:
            versions = []
            for v in range(1, rounds + 1):
                shards = {name: _slice(full(name, v), src, ctx.rank) for name in SHAPES}
                res = await engine.sync_weights(shards, version=v if ctx.rank == 0 else None)
                versions.append(res.version)
            return {"versions": versions}
    dst = {name: Layout(Mesh((1, n), t), p) for name, p in WORKER_PLACEMENTS.items()}
    targets = {name: (torch.zeros(dst[name].local_shape(shape, ctx.rank)),
                      WORKER_PLACEMENTS[name]) for name, shape in SHAPES.items()}
    async with await WorkerEngine.connect(**ctx.connect_kwargs, targets=targets,
                                          mesh_dims=(1, n), config=cfg, timeout=30) as engine:
        versions = []
        for v in range(1, rounds + 1):
            res = await engine.receive()
            for name, (tensor, _) in targets.items():
                assert torch.equal(tensor, _slice(full(name, v), dst[name], ctx.rank)), name
            versions.append(res.version)
        return {"versions": versions}


async def returns_rank(ctx: RankContext, *, fail_on: int | None = None) -> int:
    if ctx.rank == fail_on:
        raise ValueError(f"rank {ctx.rank} fails")
    return ctx.rank


async def hangs_on(ctx: RankContext, *, rank: int) -> int:
    """Rank ``rank`` blocks its whole process (a hang the world must detect)."""
    if ctx.rank == rank:
        import time

        time.sleep(600)  # noqa: ASYNC251 - the point: a rank stuck outside the loop
    return ctx.rank


async def tells(ctx: RankContext) -> int:
    import os

    ctx.event("hello", os.getpid())
    return os.getpid()
