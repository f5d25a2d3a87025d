"""Rank-process side of ``test_release``: connect / rounds / close cycles with the garbage
collector off, reporting this process's thread and fd counts after each close."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import torch

from m2n_async.testing import process_counts

from ._world import TOKEN


async def cycles(*, address: str, job: str, rank: int, cycles: int, fail: str | None,
                 **_: Any) -> list[tuple[int, int]]:
    """1 trainer + 1 worker, Gloo: ``cycles`` times connect -> a round -> close. The round
    fails on every rank when ``fail`` says how: ``"shard"``, the trainer's shard has a wrong
    shape, from a callable so that it is found at staging, in the round, not before it;
    ``"deadline"``, the worker never joins, so the trainer's round reaches its deadline with
    buckets sent and queued behind them. Returns the (threads, fds) after each close, gc
    disabled throughout."""
    from m2n_async import EngineConfig, Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine
    from m2n_async._proto.errors import M2NError

    mesh = Mesh((1, 1), 0)
    specs = [ParamSpec(f"p{i}", "float32", (8,), Layout(mesh, None)) for i in range(4)]
    late = fail == "deadline"
    # deadline: small buckets, several in flight, so that buckets wait behind the one whose
    # send times out (their waits fail on the deadline before they took their ops)
    config = EngineConfig(transport="gloo", round_timeout=1.5 if late else 30,
                          phase_timeout=30, job=job, abort_grace=1.0 if late else 2.0,
                          bucket_bytes=64 if late else EngineConfig().bucket_bytes)
    out: list[tuple[int, int]] = []
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(cycles):
            if rank == 0:
                engine: Any = await TrainerEngine.connect(
                    address, token=TOKEN, rank=0, trainer_ranks=1, world_size=2,
                    params=specs, config=config, timeout=60)
            else:
                engine = await WorkerEngine.connect(
                    address, token=TOKEN, rank=1, trainer_ranks=1, world_size=2,
                    mesh_dims=(1, 1), config=config, timeout=60,
                    targets={s.name: (torch.zeros(8), None) for s in specs})
            try:
                if rank == 0:
                    shards = {s.name: torch.ones(8) for s in specs}
                    if fail == "shard":
                        shards["p1"] = torch.ones(9)
                    await engine.sync_weights(
                        (lambda names, s=shards: {n: s[n] for n in names})
                        if fail == "shard" else shards)
                elif late:
                    await anyio.sleep(3.0)  # past the trainer's deadline and report window
                else:
                    await engine.receive(timeout=30)
            except M2NError:
                if not fail:
                    raise
            finally:
                await engine.close()
            out.append(process_counts())
    finally:
        if enabled:
            gc.enable()
    return out
