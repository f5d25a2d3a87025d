"""Soak: threads, fds and RSS of a trainer and a worker over many connect/round/close cycles
and many rounds, with the garbage collector off, so that anything ``close`` does not free
deterministically shows up as growth.

What it runs, in two spawned processes (a ``m2n_async.testing.LocalWorld`` of 1 trainer + 1
worker, Gloo lane, one torch thread each), on one store:

1. ``--cycles`` cycles of connect -> ``--cycle-rounds`` rounds -> close; every
   ``--fail-every``-th cycle the trainer passes a wrong-shaped shard in its last round, so
   that round fails on every rank (``TransferError``) and both close a poisoned engine.
2. ``--rounds`` rounds on one engine.

After each close (and every ``--every`` rounds of part 2) each process records its thread
count (``/proc/self/task``), open fds and RSS and sends them to the parent as a ``ctx.event``,
with ``gc.disable()`` in force from before the baseline:
a figure that returns to its baseline after every close means close freed the data plane
(Gloo contexts, their threads and sockets) without the collector. At the end it runs
``gc.collect()`` once and reports what that still freed.

Usage: ``python bench/soak.py [--cycles 50] [--cycle-rounds 2] [--rounds 2000] [--params 64]
[--fail-every 5] [--timeout 3600]``. Not a test: it prints figures; the test suite checks the
release itself. Exits 1 if a rank failed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from m2n_async.testing import process_counts
from m2n_async.testing._resources import _comm

if TYPE_CHECKING:
    from m2n_async.testing import RankContext, RankResult

#: After a failure, how long the other rank gets to end before it is killed (its own failure
#: takes up to a few abort_grace steps).
_FAIL_GRACE = 20.0


def _sample() -> tuple[int, int, float]:
    """(threads, open fds, RSS MB) of this process, once no joined thread is still exiting."""
    threads, fds = process_counts()  # joined threads on their way out are waited for
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    return threads, fds, rss


def _thread_names() -> str:
    """This process's threads by name (``/proc/self/task/*/comm``), e.g. ``gloo_tcp_loop x1``:
    what a residue is made of."""
    names: dict[str, int] = {}
    for task in os.listdir("/proc/self/task"):
        name = _comm(f"/proc/self/task/{task}/comm")
        if name:
            names[name] = names.get(name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(names.items()))


async def _soak_rank(ctx: RankContext, *, ns: dict[str, Any]) -> None:
    """One rank process of the world: gc off for the whole soak (back on at the end, for
    whatever the process serves next)."""
    gc.disable()  # anything close leaves to the collector stays, and shows
    try:
        await _rank(ns, ctx)
    finally:
        gc.enable()


async def _rank(ns: dict[str, Any], ctx: RankContext) -> None:
    import torch

    from m2n_async import EngineConfig, Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine
    from m2n_async._proto.errors import M2NError

    mesh = Mesh((1, 1), 0)
    specs = [ParamSpec(f"p{i}", "float32", (64,), Layout(mesh, None))
             for i in range(ns["params"])]
    config = EngineConfig(transport="gloo", round_timeout=60, phase_timeout=60,
                          job=ctx.job, abort_grace=2.0)
    shards = {s.name: torch.full((64,), float(i)) for i, s in enumerate(specs)}
    targets = {s.name: (torch.zeros(64), None) for s in specs}

    async def connect() -> Any:
        if ctx.is_trainer:
            return await TrainerEngine.connect(**ctx.connect_kwargs, params=specs,
                                               config=config, timeout=60)
        return await WorkerEngine.connect(**ctx.connect_kwargs, mesh_dims=(1, 1),
                                          targets=targets, config=config, timeout=60)

    async def one_round(engine: Any, bad: bool = False) -> None:
        if ctx.is_trainer:
            src = dict(shards)
            if bad:  # refused when its bucket is staged: the round fails on every rank
                src["p0"] = torch.zeros(65)
            await engine.sync_weights(src)
        else:
            await engine.receive(timeout=60)

    ctx.event("sample", ("baseline", _sample()))
    for c in range(ns["cycles"]):
        engine = await connect()
        failing = ns["fail_every"] > 0 and c % ns["fail_every"] == ns["fail_every"] - 1
        try:
            for k in range(ns["cycle_rounds"]):
                await one_round(engine, bad=failing and k == ns["cycle_rounds"] - 1)
        except M2NError:
            pass
        finally:
            await engine.close()
        ctx.event("sample", (f"cycle {c}{' (failed)' if failing else ''}", _sample()))
    if ns["rounds"]:
        engine = await connect()
        try:
            for k in range(ns["rounds"]):
                await one_round(engine)
                if (k + 1) % ns["every"] == 0:
                    ctx.event("sample", (f"round {k + 1}", _sample()))
        finally:
            await engine.close()
        ctx.event("sample", ("after the rounds' close", _sample()))
    ctx.event("note", ("threads", _thread_names()))
    ctx.event("note", ("freed", str(gc.collect())))
    ctx.event("sample", ("after gc.collect()", _sample()))


def _run(ns: argparse.Namespace) -> int:
    from m2n_async.testing import LocalWorld, WorldHangError

    with LocalWorld(1, 1, job_prefix="soak") as world:
        rows: dict[str, dict[int, Any]] = {}
        t0 = time.monotonic()
        run = world.start(_soak_rank, kwargs={"ns": vars(ns)})
        # Each sample as it comes, until both ranks ended (or _FAIL_GRACE after a failure).
        for ev in world.events(run, timeout=ns.timeout, fail_grace=_FAIL_GRACE):
            label, value = ev.payload
            if ev.name == "note":
                print(f"         {('trainer', 'worker')[ev.rank]}: {label}: {value}",
                      flush=True)
                continue
            row = rows.setdefault(label, {})
            row[ev.rank] = value
            if len(row) == 2:
                t, w = row[0], row[1]
                print(f"{time.monotonic() - t0:7.1f} s  {label:38s} trainer {t[0]:3d} threads "
                      f"{t[1]:3d} fds {t[2]:6.1f} MB | worker {w[0]:3d} threads {w[1]:3d} fds "
                      f"{w[2]:6.1f} MB", flush=True)
        res: Sequence[RankResult]
        try:
            res = world.collect(run, timeout=max(0.0, ns.timeout - (time.monotonic() - t0)),
                                fail_grace=_FAIL_GRACE)
        except WorldHangError as exc:  # --timeout: the stuck ranks "killed", with their stacks
            res = exc.results
    for r in res:
        if r.status == "error":
            print(f"rank {r.rank} FAILED: {r.error!r}", file=sys.stderr)
        elif r.status != "ok":
            print(f"rank {r.rank} FAILED: {r.status} (exit code {r.exitcode})\n{r.stacks}",
                  file=sys.stderr)
    return 0 if all(r.ok for r in res) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--cycle-rounds", type=int, default=2)
    ap.add_argument("--fail-every", type=int, default=5,
                    help="every Nth cycle's last round fails (0: never)")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--every", type=int, default=250, help="sample every N rounds")
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds for the whole soak; then the ranks' stacks and a kill")
    ns = ap.parse_args(argv)
    print(f"soak: 1 trainer + 1 worker (gloo), gc disabled; {ns.cycles} cycles of "
          f"{ns.cycle_rounds} rounds (every {ns.fail_every}th failing), then {ns.rounds} "
          f"rounds; {ns.params} params")
    return _run(ns)


if __name__ == "__main__":
    sys.exit(main())
