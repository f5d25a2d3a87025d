"""Rank functions the toolkit's tests run in a ``LocalWorld`` (not a test module).

A toy model of two parameters: trainers hold row shards (an FSDP-like layout on a (T, 1)
mesh), workers a (1, N) tensor-parallel layout; every round's content is a function of the
version, so a worker checks its shard bit-exactly.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any

import anyio
import anyio.to_thread
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


async def raises_from_a_class_only_it_has(ctx: RankContext) -> int:
    """Raise a ``ValueError`` from an exception whose class lives in a module only this rank
    has: it pickles and unpickles in the rank, but not in the test process."""
    import sys
    import types

    mod = types.ModuleType("only_in_the_rank")
    mod.Local = type("Local", (Exception,), {"__module__": "only_in_the_rank"})  # type: ignore[attr-defined]
    sys.modules["only_in_the_rank"] = mod
    try:
        raise mod.Local("the rank's own error")  # type: ignore[attr-defined]
    except Exception as exc:
        raise ValueError(f"rank {ctx.rank} failed") from exc


async def hangs_on(ctx: RankContext, *, rank: int) -> int:
    """Rank ``rank`` blocks its whole process (a hang the world must detect)."""
    if ctx.rank == rank:
        time.sleep(600)  # noqa: ASYNC251 - the point: a rank stuck outside the loop
    return ctx.rank


async def _waits_forever() -> None:
    await anyio.sleep(3600)


async def awaits_forever_on(ctx: RankContext, *, rank: int) -> int:
    """Rank ``rank`` waits on an ``await`` that never ends (its loop idle in ``select``)."""
    if ctx.rank == rank:
        await _waits_forever()
    return ctx.rank


async def tells(ctx: RankContext) -> int:
    ctx.event("hello", os.getpid())
    return os.getpid()


def _wait_for(path: str) -> None:
    """Until ``path`` exists (60 s at most: then the rank fails, naming it)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


async def ticks_then_waits(ctx: RankContext, *, flag: str) -> int:
    """Every rank sends ``tick`` 0, 1, 2; rank 0 then sends ``asked`` and waits (60 s at
    most) until the test creates ``flag`` — which it can only do if it sees the event while
    rank 0 still runs."""
    for k in range(3):
        ctx.event("tick", k)
    if ctx.rank == 0:
        ctx.event("asked")
        await anyio.to_thread.run_sync(_wait_for, flag)
    return ctx.rank


async def fails_while_others_hang(ctx: RankContext, *, culprit: int, how: str) -> int:
    """Rank ``culprit`` raises (``how="raise"``) or exits with status 3 (``"exit"``); every
    other rank blocks its process for 10 minutes."""
    if ctx.rank == culprit:
        if how == "exit":
            os._exit(3)
        raise ValueError(f"rank {ctx.rank} fails")
    time.sleep(600)  # noqa: ASYNC251 - the point: ranks that never end by themselves
    return ctx.rank


async def tells_then_hangs(ctx: RankContext, *, rank: int, event: str) -> int:
    """Rank ``rank`` sends ``event`` and blocks for 10 minutes; the others return."""
    if ctx.rank == rank:
        ctx.event(event)
        time.sleep(600)  # noqa: ASYNC251 - only the test can end it
    return ctx.rank


async def dies_holding_queue_locks(ctx: RankContext, *, rank: int, flag: str) -> int:
    """Rank ``rank`` takes the lock of every ``multiprocessing`` queue its process holds
    and exits with them held (status 3), as a process killed halfway through a write would;
    the others return only after that."""
    import multiprocessing.queues

    if ctx.rank == rank:
        for q in gc.get_objects():
            # type(), not isinstance: that would read __class__ of torch's lazy modules,
            # which warn when touched
            if issubclass(type(q), multiprocessing.queues.Queue):
                for lock in (q._rlock, q._wlock):  # type: ignore[attr-defined]
                    if lock is not None:
                        lock.acquire(timeout=1)
        _touch(flag)
        os._exit(3)
    await anyio.to_thread.run_sync(_wait_for, flag)
    return ctx.rank


async def stops_halfway_through_a_message(ctx: RankContext, *, rank: int) -> int:
    """Rank ``rank`` writes the first bytes of a message to its pipe, then stops itself
    (``SIGSTOP``): the rest never comes, and the pipe stays open."""
    if ctx.rank == rank:
        os.write(ctx._events.fileno(), (1000).to_bytes(8, "big") + b"abc")
        os.kill(os.getpid(), signal.SIGSTOP)
    return ctx.rank


async def counts_into(ctx: RankContext, *, path: str, rank: int) -> int:
    """Rank ``rank`` writes a rising counter to ``path`` every 20 ms, for good; the others
    wait (the test kills them)."""
    if ctx.rank == rank:
        n = 0
        while True:
            n += 1
            with open(path, "w") as f:  # noqa: ASYNC230 - a few bytes: what the test reads
                f.write(str(n))
            await anyio.sleep(0.02)
    await anyio.sleep(600)
    return ctx.rank


async def raises_while_stacks_are_taken(ctx: RankContext, *, stacks: str) -> int:
    """Rank 0 raises, rank 1 hangs; rank 2 raises the moment the world starts taking rank
    1's stacks (once ``fail_grace`` ran out), so its answer arrives during the give-up."""
    if ctx.rank == 0:
        raise ValueError("first")
    if ctx.rank == 1:
        await anyio.sleep(600)
    # polled: the world writes the file from outside this process (nothing to await)
    while not os.path.exists(stacks) or os.path.getsize(stacks) == 0:  # noqa: ASYNC240, ASYNC110
        await anyio.sleep(0.002)
    raise ValueError("second")


async def notices_a_freeze(ctx: RankContext, *, rank: int) -> int:
    """Rank ``rank`` sends ``ready`` and ticks; the moment it runs again after a pause (it was
    frozen, then resumed) it raises. Every other rank raises after a second."""
    if ctx.rank == rank:
        ctx.event("ready")
        last = time.monotonic()
        while True:
            await anyio.sleep(0.01)
            if time.monotonic() - last > 0.5:
                raise ValueError(f"rank {rank} ran again after a freeze")
            last = time.monotonic()
    await anyio.sleep(1.0)
    raise ValueError(f"rank {ctx.rank} fails first")


class KeywordOnly(Exception):
    """An exception whose ``__init__`` takes a keyword ``args`` lacks: it does not unpickle."""

    def __init__(self, message: str, *, what: str) -> None:
        super().__init__(message)
        self.what = what


async def raises_one_that_does_not_unpickle(ctx: RankContext) -> int:
    raise KeywordOnly(f"rank {ctx.rank} failed", what="x")
