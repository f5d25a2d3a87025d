"""Preflight cost: every rank of a T+N world runs the handshake as a task of one event loop.

All ranks share one core here, so the total is the sum of every rank's CPU work (decode the
shipped specs, build and check the plan, digests) plus the in-memory store; one rank of a
real job pays about total / (T + N) of it, plus network round trips (one per phase).

    python bench/preflight_bench.py --trainers 8 --workers 8 --params 10000
"""

from __future__ import annotations

import argparse
import time

import anyio

from m2n_async._engine._preflight import PreflightInputs, PreflightOutcome, run_preflight
from m2n_async._proto.handshake import PreflightPlan
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.messages import DataPlaneIdentity
from m2n_async._proto.params import ParamSpec
from m2n_async._store import ControlGroup
from m2n_async.testing import MemoryStore


async def _prepare(plan: PreflightPlan) -> None:
    """No local resources in the bench."""


async def bench(t: int, n: int, p: int) -> tuple[float, PreflightOutcome]:
    mesh = Mesh((t, 1))
    specs = [ParamSpec(f"layers.{i}.w", "bfloat16", (128 * t, 64 * n * (1 + i % 7)),
                       Layout(mesh, (0, REPLICATE))) for i in range(p)]
    placements: dict[str, tuple[int, int] | None] = {
        s.name: (REPLICATE, 1) if i % 3 else None for i, s in enumerate(specs)}

    def inputs(r: int) -> PreflightInputs:
        trainer = r < t
        return PreflightInputs(
            role="trainer" if trainer else "worker", rank=r, world_size=t + n,
            trainer_ranks=t, generation=1, params=specs if trainer else None,
            mesh_dims=None if trainer else (1, n),
            dst_placements=None if trainer else placements, transport="auto",
            capabilities=lambda: ["nccl", "gloo"],
            data_plane_identity=lambda name: DataPlaneIdentity("2.30.7", None, ()),
            prepare_runtime=_prepare)

    root = MemoryStore()
    outcomes: dict[int, PreflightOutcome] = {}

    async def one(r: int) -> None:
        group = ControlGroup(root.session(), r, t + n, "bench/1/preflight")
        outcomes[r] = await run_preflight(group, inputs(r), phase_timeout=120.0)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for r in range(t + n):
            tg.start_soon(one, r)
    return time.perf_counter() - started, outcomes[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--params", type=int, default=10_000)
    args = ap.parse_args()
    total, out = anyio.run(bench, args.trainers, args.workers, args.params)
    ranks = args.trainers + args.workers
    phases = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in out.seconds.items())
    print(f"preflight {args.trainers}+{args.workers} ranks, {args.params} params: "
          f"{total:.2f} s for all ranks in one loop ({total / ranks * 1e3:.0f} ms per rank); "
          f"transport {out.transport}; rank 0 phases: {phases}")


if __name__ == "__main__":
    main()
