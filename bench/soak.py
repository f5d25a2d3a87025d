"""Soak: threads, fds and RSS of a trainer and a worker over many connect/round/close cycles
and many rounds, with the garbage collector off, so that anything ``close`` does not free
deterministically shows up as growth.

What it runs, in two spawned processes (1 trainer + 1 worker, Gloo lane, one torch thread
each), on one store:

1. ``--cycles`` cycles of connect -> ``--cycle-rounds`` rounds -> close; every
   ``--fail-every``-th cycle the trainer passes a wrong-shaped shard in its last round, so
   that round fails on every rank (``TransferError``) and both close a poisoned engine.
2. ``--rounds`` rounds on one engine.

After each close (and every ``--every`` rounds of part 2) each process records its thread
count (``/proc/self/task``), open fds and RSS, with ``gc.disable()`` in force from the start:
a figure that returns to its baseline after every close means close freed the data plane
(Gloo contexts, their threads and sockets) without the collector. At the end it runs
``gc.collect()`` once and reports what that still freed.

Usage: ``python bench/soak.py [--cycles 50] [--cycle-rounds 2] [--rounds 2000] [--params 64]
[--fail-every 5]``. Not a test: it prints figures; the test suite checks the release itself.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import secrets
import sys
import time
from typing import Any

import anyio


def _sample() -> tuple[int, int, float]:
    """(threads, open fds, RSS MB) of this process."""
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    return threads, fds, rss


def _thread_names() -> str:
    """This process's threads by name (``/proc/self/task/*/comm``), e.g. ``gloo_tcp_loop x1``:
    what a residue is made of."""
    names: dict[str, int] = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            name = f.read().strip()
        names[name] = names.get(name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(names.items()))


async def _rank(ns: dict[str, Any], rank: int, out: Any) -> None:
    import torch

    from m2n_async import EngineConfig, Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine
    from m2n_async._proto.errors import M2NError

    mesh = Mesh((1, 1), 0)
    specs = [ParamSpec(f"p{i}", "float32", (64,), Layout(mesh, None))
             for i in range(ns["params"])]
    config = EngineConfig(transport="gloo", round_timeout=60, phase_timeout=60,
                          job="soak", abort_grace=2.0)
    shards = {s.name: torch.full((64,), float(i)) for i, s in enumerate(specs)}
    targets = {s.name: (torch.zeros(64), None) for s in specs}

    async def connect() -> Any:
        if rank == 0:
            return await TrainerEngine.connect(ns["address"], token=ns["token"], rank=0,
                                               trainer_ranks=1, world_size=2, params=specs,
                                               config=config, timeout=60)
        return await WorkerEngine.connect(ns["address"], token=ns["token"], rank=1,
                                          trainer_ranks=1, world_size=2, mesh_dims=(1, 1),
                                          targets=targets, config=config, timeout=60)

    async def one_round(engine: Any, bad: bool = False) -> None:
        if rank == 0:
            src = dict(shards)
            if bad:  # refused when its bucket is staged: the round fails on every rank
                src["p0"] = torch.zeros(65)
            await engine.sync_weights(src)
        else:
            await engine.receive(timeout=60)

    out.put((rank, "baseline", _sample()))
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
        out.put((rank, f"cycle {c}{' (failed)' if failing else ''}", _sample()))
    if ns["rounds"]:
        engine = await connect()
        try:
            for k in range(ns["rounds"]):
                await one_round(engine)
                if (k + 1) % ns["every"] == 0:
                    out.put((rank, f"round {k + 1}", _sample()))
        finally:
            await engine.close()
        out.put((rank, "after the rounds' close", _sample()))
    out.put((rank, "threads", _thread_names()))
    out.put((rank, "freed", str(gc.collect())))
    out.put((rank, "after gc.collect()", _sample()))


def _child(ns: dict[str, Any], rank: int, out: Any) -> None:
    gc.disable()  # anything close leaves to the collector stays, and shows
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        anyio.run(_rank, ns, rank, out)
    except BaseException as exc:
        out.put((rank, "error", repr(exc)))
    out.put((rank, "end", None))


async def _run(ns: argparse.Namespace) -> int:
    from m2n_async import StoreServer

    token = secrets.token_hex(16)
    async with StoreServer(host="127.0.0.1", port=0, token=token) as server:
        args = dict(vars(ns), address=server.address, token=token)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(args, r, out), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        ended = 0
        rows: dict[str, dict[int, Any]] = {}
        t0 = time.monotonic()
        while ended < 2:
            rank, label, value = await anyio.to_thread.run_sync(out.get)
            if label == "end":
                ended += 1
                continue
            if label == "error":
                print(f"rank {rank} FAILED: {value}", file=sys.stderr)
                continue
            if label in ("threads", "freed"):
                print(f"         {('trainer', 'worker')[rank]}: {label}: {value}", flush=True)
                continue
            row = rows.setdefault(label, {})
            row[rank] = value
            if len(row) == 2:
                t, w = row[0], row[1]
                print(f"{time.monotonic() - t0:7.1f} s  {label:38s} trainer {t[0]:3d} threads "
                      f"{t[1]:3d} fds {t[2]:6.1f} MB | worker {w[0]:3d} threads {w[1]:3d} fds "
                      f"{w[2]:6.1f} MB", flush=True)
        for p in procs:
            p.join(10)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--cycle-rounds", type=int, default=2)
    ap.add_argument("--fail-every", type=int, default=5,
                    help="every Nth cycle's last round fails (0: never)")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--every", type=int, default=250, help="sample every N rounds")
    ap.add_argument("--params", type=int, default=64)
    ns = ap.parse_args(argv)
    print(f"soak: 1 trainer + 1 worker (gloo), gc disabled; {ns.cycles} cycles of "
          f"{ns.cycle_rounds} rounds (every {ns.fail_every}th failing), then {ns.rounds} "
          f"rounds; {ns.params} params")
    return anyio.run(_run, ns)


if __name__ == "__main__":
    sys.exit(main())
