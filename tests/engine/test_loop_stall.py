"""``SyncResult.loop_stall_seconds``: a rank whose event loop is blocked during a round says so.

A 1 + 1 Gloo world (``m2n_async.testing.LocalWorld``, through the ``m2n_world`` fixture). In
the second round the worker's own "generation loop" — a task beside ``receive`` — blocks the
event loop with ``time.sleep`` once the first bucket arrived, as a digest of a large tensor
computed on the loop would; the first round runs undisturbed. The worker's figure for the
blocked round must reach what was slept (less the probe's period and slack), exceed the
undisturbed round's, and appear in ``summary()``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import torch

from m2n_async import Layout, Mesh, ParamSpec, SyncResult, TrainerEngine, WorkerEngine
from m2n_async.testing import LocalWorld, RankContext

BLOCK_S = 0.5
#: The probe's period (a block that starts just before a wake-up is seen one period short)
#: plus its per-wake-up slack, with room for a coarse timer.
TOLERANCE_S = 0.05
SHAPES = {f"w{i}": (8, 4) for i in range(6)}


def _full(name: str, version: int) -> torch.Tensor:
    return torch.full(SHAPES[name], float(version)) + int(name[1:])


def _figures(res: SyncResult) -> dict[str, Any]:
    return {"stall": res.loop_stall_seconds, "seconds": res.seconds, "buckets": res.buckets,
            "summary": res.summary()}


async def stall_rank(ctx: RankContext, *, block_on_round: int, rounds: int = 2
                     ) -> list[dict[str, Any]]:
    # 128-byte tensors in 64-byte buckets: several buckets, so the round is still running
    # after the first one's progress call.
    cfg = ctx.config(bucket_bytes=64)
    out = []
    if ctx.is_trainer:
        src = Layout(Mesh((1, 1), 0), None)
        specs = [ParamSpec(n, torch.float32, s, src) for n, s in SHAPES.items()]
        async with await TrainerEngine.connect(**ctx.connect_kwargs, params=specs,
                                               config=cfg, timeout=30) as engine:
            for v in range(1, rounds + 1):
                res = await engine.sync_weights({n: _full(n, v) for n in SHAPES}, version=v)
                out.append(_figures(res))
        return out
    targets = {n: (torch.zeros(s), None) for n, s in SHAPES.items()}
    async with await WorkerEngine.connect(**ctx.connect_kwargs, targets=targets,
                                          mesh_dims=(1, 1), config=cfg, timeout=30) as engine:
        for v in range(1, rounds + 1):
            first_bucket = anyio.Event()

            async def generation_loop(first: anyio.Event = first_bucket) -> None:
                await first.wait()
                # Synchronous work on the engine's event loop: what is measured.
                time.sleep(BLOCK_S)  # noqa: ASYNC251

            async with anyio.create_task_group() as tg:
                if v == block_on_round:
                    tg.start_soon(generation_loop)
                res = await engine.receive(progress=lambda done, total, e=first_bucket: e.set())
                first_bucket.set()  # set by the first bucket already; a guard, not a step
            for n, (t, _) in targets.items():
                assert torch.equal(t, _full(n, v)), n
            out.append(_figures(res))
    return out


def test_a_blocked_worker_loop_shows_in_its_round_result(m2n_world: Any) -> None:
    world: LocalWorld = m2n_world(1, 1)
    res = world.run(stall_rank, kwargs={"block_on_round": 2}, timeout=120)
    assert all(r.ok for r in res), [(r.rank, r.error, r.traceback) for r in res]
    trainer, worker = res.values
    calm, blocked = worker
    assert blocked["buckets"] > 1, blocked
    assert blocked["stall"] >= BLOCK_S - TOLERANCE_S, blocked
    assert blocked["stall"] > calm["stall"], (calm, blocked)
    assert "event loop stalled" in blocked["summary"], blocked["summary"]
    # The trainer's loop was free while it waited for the blocked worker.
    assert trainer[1]["stall"] < blocked["stall"], (trainer, blocked)


def _result(seconds: float, stall: float) -> SyncResult:
    return SyncResult(version=1, round=1, generation=1, bytes=1000, seconds=seconds,
                      loop_stall_seconds=stall)


def test_summary_shows_a_stall_only_when_it_is_significant() -> None:
    assert _result(1.0, 0.0).loop_stall_seconds == 0.0
    assert "stalled" not in _result(1.0, 0.0).summary()
    assert "stalled" not in _result(1.0, 0.05).summary()     # under a tenth of the round
    assert "stalled" not in _result(0.02, 0.005).summary()   # under the 10 ms floor
    line = _result(2.0, 0.5).summary().splitlines()[-1]
    assert line.startswith("  event loop stalled 0.500 s (25% of the round)"), line
