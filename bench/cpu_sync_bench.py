"""CPU sync bench: ``sync_weights`` over Gloo vs raw Gloo point-to-point, in one run.

What it measures, all in the same spawned processes (2 trainers + 2 workers, one torch thread
each: a ``m2n_async.testing.LocalWorld``, started before anything is timed), side by side:

1. Throughput. The demo's synthetic model (``m2n_async._demo.demo_model``: row/column
   reshards, replicated tensors, 3-D experts EP -> TP, many small tensors) moves through
   ``TrainerEngine.sync_weights`` / ``WorkerEngine.receive``; the baseline moves exactly the
   same bytes per (trainer, worker) pair as one pre-packed buffer per pair with raw
   ``torch.distributed`` Gloo ``isend``/``irecv`` on the default process group (which the
   engine's own group lives beside). Rounds alternate engine / raw so that background load on
   a shared machine hits both alike; each round is timed from a barrier to the slowest rank's
   finish. Figure: median raw time / median engine time (goal >= 0.9).
2. Host overhead per parameter. 100,000 tiny fp32 parameters (64 B each) from one trainer to
   one worker (processes 0 and 2): (median engine round - median raw Gloo send of the same
   6.4 MB) / 100,000 (goal <= 20 us; stretch goal <= 0.5 us, BENCHMARKS.md "CPU sync").
   Beside it, in the same rounds: raw Gloo plus the copies alone, once as torch's own
   (``torch.cat``, ``_foreach_copy_``) and once through the address tables the Gloo lane
   uses (``_data/_hostcopy.py``: the floor), and the engine's checks alone: the fast pass
   (a round's first) and the re-check of chunks that passed (every round after it).
3. Event-loop lag. On trainer rank 0, a task sleeps 1 ms in a loop during every engine round
   and records how late it wakes; p99 over the rounds of each part (goal <= 5 ms).

After the last throughput round every worker checks its tensors bit-exact against the demo's
recomputation, so the figures are for transfers that were right.

Usage: ``.venv/bin/python bench/cpu_sync_bench.py [--size-mb 350] [--rounds 5]
[--tiny-params 100000] [--tiny-rounds 3] [--bucket-mb 64] [--max-inflight 3]
[--parts mixed,aligned,tiny] [--tiny-masters] [--profile DIR] [--api-marks DIR]``;
``--tiny`` runs everything at toy size (the test suite's smoke run: ``TINY``), a size flag
given beside it still wins; ``--tiny-masters`` moves part 2 as bf16 from fp32 master shards
(cast while packing); ``--profile`` writes a cProfile of each rank process's main thread,
``--api-marks`` a timeline of the public API's steps per part (``bench/api_marks.py``).
"""

from __future__ import annotations

import argparse
import operator
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

if TYPE_CHECKING:
    from m2n_async.testing import RankContext
    from m2n_async.testing import RankResult as WorldRank

#: The parts, in the order they run, each with its fixed number in the report.
PARTS = {"mixed": "1a", "aligned": "1b", "tiny": "2"}
#: The sizes of a full run, and ``--tiny``'s (the test suite's smoke run); a flag given on the
#: command line wins over both.
FULL: dict[str, float] = {"size_mb": 350.0, "rounds": 5, "tiny_params": 100_000,
                          "tiny_rounds": 3}
TINY: dict[str, float] = {"size_mb": 4.0, "rounds": 2, "tiny_params": 2000, "tiny_rounds": 2}
#: BENCHMARKS.md "CPU sync": host overhead per tiny parameter, goal and stretch goal.
OVERHEAD_GOAL_S = 20e-6
OVERHEAD_STRETCH_S = 0.5e-6

TINY_TRAINER = 0  # part 2 runs on process 0 (engine rank 0) and the first worker process
#: After a rank's failure, how long the others (blocked in a Gloo barrier, say) get to end
#: before they are killed.
_FAIL_GRACE = 30.0


@dataclass(frozen=True)
class Args:
    size_mb: float
    rounds: int
    tiny_params: int
    tiny_rounds: int
    bucket_mb: float
    address: str
    token: str
    pg_file: str
    profile: str | None = None
    parts: tuple[str, ...] = ("mixed", "aligned", "tiny")
    max_inflight: int = 3
    trainers: int = 2
    workers: int = 2
    api_marks: str | None = None
    tiny_masters: bool = False  # part 2: bf16 on the wire from fp32 master shards

    @property
    def world(self) -> int:
        return self.trainers + self.workers


class Throughput(msgspec.Struct):
    layout: str                        # "mixed" (the demo's layouts) or "aligned"
    engine_s: list[float] = []         # slowest rank's seconds per timed round
    raw_s: list[float] = []
    raw_copy_s: list[float] = []       # raw + the engine's packing copies, done serially
    bytes_moved: int = 0               # the plan's bytes sent (trainer) / received (worker)
    phases: dict[str, float] = {}      # this rank's last SyncResult.phases
    peak_mb: float = 0.0               # and its peak_extra_bytes, MB
    mismatched: list[str] = []         # workers: tensors not bit-exact
    lag: list[float] = []              # trainer rank 0: overshoot of 1 ms sleeps, seconds
    lag_raw: list[float] = []          # the same during the raw rounds (control)
    lag_copy: list[float] = []         # the same during the raw + copies rounds (control)
    cpu: list[tuple[float, float]] = []      # this rank's (user, sys) seconds per engine round
    cpu_raw: list[tuple[float, float]] = []  # the same per raw round
    cpu_copy: list[tuple[float, float]] = []  # the same per raw + copies round
    copy_mb: float = 0.0               # MB this rank copies (packs or unpacks) per round


class RankFigures(msgspec.Struct):
    """What one rank process measured (its rank function's return value)."""

    rank: int
    throughput: list[Throughput] = []  # part 1, one per layout
    tiny_engine_s: list[float] = []    # part 2 (processes 0 and 2)
    tiny_raw_s: list[float] = []
    tiny_connect_s: float = 0.0
    tiny_first_s: float = 0.0  # the first (untimed) round: tables, plans, arenas built
    tiny_phases: dict[str, float] = {}  # this rank's last part-2 SyncResult.phases
    tiny_floor_s: list[float] = []     # raw + the copies without checks: torch's own floor
    tiny_table_s: list[float] = []     # raw + the copies through address tables, no checks
    tiny_check_s: list[float] = []     # one fast pass of the checks over the shards
    tiny_recheck_s: list[float] = []   # the re-check of chunks that passed: the checks' floor
    lag_tiny: list[float] = []


# -- the rank processes ----------------------------------------------------------------------


async def _bench_rank(ctx: RankContext, *, args: Args) -> RankFigures:
    """One rank process of the world (torch imported, one torch thread): every part, its
    figures returned."""
    out = RankFigures(ctx.rank)
    if args.api_marks:
        import api_marks  # bench/, beside this script

        api_marks.install(args.api_marks)
    if not args.profile:
        await _rank(args, ctx.rank, out)
        return out
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        await _rank(args, ctx.rank, out)
    finally:
        prof.disable()
        os.makedirs(args.profile, exist_ok=True)  # the rank writes its own file: no race
        prof.dump_stats(os.path.join(args.profile, f"rank{ctx.rank}.prof"))
    return out


async def _timed(op: Callable[[], Awaitable[Any]], lag: list[float] | None,
                 group: Any = None, cpu: list[tuple[float, float]] | None = None
                 ) -> tuple[float, Any]:
    """Barrier, run ``op``, return (the slowest rank's seconds, ``op``'s value): a round ends
    when its last rank is done. With ``lag``, a task sleeping 1 ms on this event loop records
    how late it wakes while ``op`` runs. ``group``: the Gloo group of the ranks involved.
    ``cpu`` gets this process's (user, sys) CPU seconds spent from barrier to its finish."""
    import resource

    import torch
    import torch.distributed as dist

    dist.barrier(group=group)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if lag is None:
        value = await op()
    else:
        async def probe() -> None:
            while True:
                t = time.perf_counter()
                await anyio.sleep(0.001)
                lag.append(time.perf_counter() - t - 0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            value = await op()
            tg.cancel_scope.cancel()
    if cpu is not None:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item()), value


def _raw_exchange(sends: dict[int, Any], recvs: dict[int, Any]) -> None:
    """Every send and receive posted at once, then waited: the best Gloo can do with the
    bytes already packed per peer."""
    import torch.distributed as dist

    works = [dist.isend(buf, dst) for dst, buf in sends.items()]
    works += [dist.irecv(buf, src) for src, buf in recvs.items()]
    for w in works:
        if w is not None:  # None only for a peer outside the group (typed Optional)
            w.wait()


def _copy_jobs(plan: Any, rank: int, bucket_bytes: int, bufs: dict[int, Any],
               tensors: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The packing copies the engine's Gloo transport makes on this rank per round, as
    (destination, source) byte views: a trainer packs every message that cannot go zero-copy
    from its shard into its place in the raw per-peer buffer; a worker copies every message
    that cannot land in place from the raw buffer into ``tensors``. The same message split
    (``plan_bucket(split_runs=True)``) and buckets as the engine."""
    from m2n_async._data._packing import byte_view, plan_bucket
    from m2n_async._proto.plan import MAX_BUCKET_PARAMS, split_buckets

    sending = rank < plan.trainer_ranks
    names = [p.spec.name for p in plan.params]
    base = dict.fromkeys(bufs, 0)  # where this bucket's bytes for a peer start in its buffer
    jobs = []
    for bucket in split_buckets(plan, plan.buckets(bucket_bytes), MAX_BUCKET_PARAMS):
        bp = plan_bucket(plan, bucket, rank, split_runs=True)
        for peer in bp.peers:
            buf = bufs[peer.peer]
            for msg in peer.messages:
                if msg.direct is not None:
                    continue
                for seg in msg.segments:
                    a = base[peer.peer] + seg.offset
                    flat = buf[a:a + seg.nbytes].view(seg.shape)
                    local = byte_view(tensors[names[seg.param]])[seg.slices]
                    jobs.append((flat, local) if sending else (local, flat))
            base[peer.peer] += peer.nbytes
    return jobs


async def _rank(args: Args, rank: int, out: RankFigures) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{args.pg_file}", rank=rank,
                            world_size=args.world)
    try:
        for layout in ("mixed", "aligned"):
            if layout in args.parts:
                _tag(args, layout)
                out.throughput.append(Throughput(layout))
                await _part_throughput(args, rank, out.throughput[-1])
                dist.barrier()
        if "tiny" in args.parts:
            _tag(args, "tiny")
            await _part_tiny(args, rank, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _tag(args: Args, part: str) -> None:
    """``--api-marks``: the rounds that follow belong to ``part``."""
    if args.api_marks:
        import api_marks

        api_marks.set_tag(part)


async def _part_throughput(args: Args, rank: int, out: Throughput) -> None:
    """Part 1 for one layout: "mixed" is the demo model as is (reshards: pieces packed);
    "aligned" gives every tensor the same placements on both meshes, so every piece is a
    whole local shard and moves zero-copy — what is left is the engine's own overhead."""
    import dataclasses

    import torch

    from m2n_async import EngineConfig, TrainerEngine, WorkerEngine
    from m2n_async._demo import _bytes_2d, base_content, demo_model, demo_plan, mismatches

    params = demo_model(args.size_mb, args.trainers, args.workers)
    if out.layout == "aligned":
        params = [dataclasses.replace(p, dst=p.src) for p in params]
    plan = demo_plan(params, args.trainers, args.workers)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    config = EngineConfig(transport="gloo", bucket_bytes=bucket_bytes,
                          max_inflight=args.max_inflight, round_timeout=120,
                          job=f"bench-{out.layout}")
    # Raw baseline buffers: per peer, the bytes the plan moves between us, as one buffer.
    pair = {peer: 0 for peer in range(args.world)}
    for i in range(len(plan.params)):
        pieces = (plan.pieces_from(i, rank) if rank < args.trainers else plan.pieces_to(i, rank))
        for pc in pieces:
            pair[pc.dst_rank if rank < args.trainers else pc.src_rank] += pc.nbytes
    # Filled, not just allocated: a send from never-written memory reads the kernel's shared
    # zero page, which is always in cache — measured 50 vs 72 ms (sys 8-16 vs 24-30 ms) for
    # 189 MB between two processes here. The baseline must copy real pages, as the engine does.
    bufs = {peer: torch.full((n,), 0x5A, dtype=torch.uint8) for peer, n in pair.items() if n}
    sends, recvs = (bufs, {}) if rank < args.trainers else ({}, bufs)
    lag = out.lag if rank == 0 else None
    lag_raw = out.lag_raw if rank == 0 else None
    lag_copy = out.lag_copy if rank == 0 else None

    async def raw() -> None:
        # On a thread (Gloo waits release the GIL) so the lag probe runs meanwhile: the
        # control figure for the event-loop lag that CPU contention alone causes.
        await anyio.to_thread.run_sync(_raw_exchange, sends, recvs)

    def exchange_with_copies() -> None:
        if rank < args.trainers:
            for dst, src in copies:
                dst.copy_(src)
        _raw_exchange(sends, recvs)
        if rank >= args.trainers:
            for dst, src in copies:
                dst.copy_(src)

    async def raw_copy() -> None:
        await anyio.to_thread.run_sync(exchange_with_copies)

    if rank < args.trainers:
        shards = {p.name: base_content(p.name, p.shape, p.dtype, t.spec.layout.box(p.shape, rank))
                  for p, t in zip(params, plan.params, strict=True)}
        copies = _copy_jobs(plan, rank, bucket_bytes, bufs, shards)
        engine: Any = await TrainerEngine.connect(
            args.address, token=args.token, rank=rank, trainer_ranks=args.trainers,
            world_size=args.world, params=plan.source_specs(), config=config, timeout=300)

        async def op() -> Any:
            return await engine.sync_weights(shards)
        out.bytes_moved = plan.send_bytes(rank)
    else:
        boxes = {p.name: t.dst.box(p.shape, rank) for p, t in zip(params, plan.params,
                                                                  strict=True)}
        targets = {p.name: torch.zeros([hi - lo for lo, hi in boxes[p.name]],
                                       dtype=getattr(torch, p.dtype)) for p in params}
        # The raw+copies baseline unpacks into copies of the targets: the real ones are
        # checked bit-exact after the engine's rounds.
        copies = _copy_jobs(plan, rank, bucket_bytes, bufs,
                            {n: torch.zeros_like(t) for n, t in targets.items()})
        engine = await WorkerEngine.connect(
            args.address, token=args.token, rank=rank, trainer_ranks=args.trainers,
            world_size=args.world, mesh_dims=(1, args.workers), config=config, timeout=300,
            targets={p.name: (targets[p.name], t.dst.placements)
                     for p, t in zip(params, plan.params, strict=True)})

        async def op() -> Any:
            return await engine.receive(timeout=120)
        out.bytes_moved = plan.recv_bytes(rank)
    try:
        await _timed(op, None)   # warm-up: first-touch of arenas and targets, connections
        await _timed(raw, None)
        for _ in range(args.rounds):
            seconds, res = await _timed(op, lag, cpu=out.cpu)
            out.engine_s.append(seconds)
            out.raw_s.append((await _timed(raw, lag_raw, cpu=out.cpu_raw))[0])
            out.raw_copy_s.append((await _timed(raw_copy, lag_copy, cpu=out.cpu_copy))[0])
        out.copy_mb = sum(d.numel() for d, _ in copies) / 1e6
        out.phases = dict(res.phases)
        out.peak_mb = res.peak_extra_bytes / 1e6
        if rank >= args.trainers:
            base = {p.name: _bytes_2d(base_content(p.name, p.shape, p.dtype, boxes[p.name]))
                    for p in params}
            scratch = torch.empty(max(p.nbytes for p in params), dtype=torch.uint8)
            out.mismatched = mismatches(params, targets, base, 0, scratch)
    finally:
        await engine.close()


async def _part_tiny(args: Args, rank: int, out: RankFigures) -> None:
    """Part 2 on processes 0 (trainer rank 0) and 2 (worker rank 1); the others wait."""
    import torch
    import torch.distributed as dist

    from m2n_async import EngineConfig, Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine

    try:
        from m2n_async._data import _hostcopy
    except ImportError:  # a tree from before the address tables
        _hostcopy = None  # type: ignore[assignment]

    # new_group is collective over the default group: every process creates it.
    tiny_worker = args.trainers  # the first worker process
    sub = dist.new_group([TINY_TRAINER, tiny_worker])
    if rank not in (TINY_TRAINER, tiny_worker):
        return
    n = args.tiny_params
    smesh = Mesh((1, 1), 0)
    wire = torch.bfloat16 if args.tiny_masters else torch.float32
    specs = [ParamSpec(f"tiny.{i}", str(wire).removeprefix("torch."), (16,),
                       Layout(smesh, None)) for i in range(n)]
    config = EngineConfig(transport="gloo", bucket_bytes=int(args.bucket_mb * (1 << 20)),
                          max_inflight=args.max_inflight, round_timeout=300,
                          phase_timeout=120, job="bench-tiny")
    total = n * 16 * wire.itemsize
    lag = out.lag_tiny if rank == TINY_TRAINER else None
    t0 = time.perf_counter()
    if rank == TINY_TRAINER:
        flat = torch.rand(n * 16, generator=torch.Generator().manual_seed(0))
        shards = {s.name: flat[16 * i:16 * (i + 1)].clone() for i, s in enumerate(specs)}
        engine: Any = await TrainerEngine.connect(
            args.address, token=args.token, rank=0, trainer_ranks=1, world_size=2,
            params=specs, config=config, timeout=600)

        async def op() -> Any:
            return await engine.sync_weights(shards)
        buf = torch.full((total,), 0x5A, dtype=torch.uint8)  # real pages (see part 1)
        ordered = list(shards.values())
        flat_out = buf.view(wire)  # torch.cat casts fp32 masters into it

        async def raw() -> None:
            dist.send(buf, tiny_worker)

        async def floor() -> None:  # the copies any packer must make, then the send
            torch.cat(ordered, out=flat_out)
            dist.send(buf, tiny_worker)

        # The same copy through an address table (what the engine's Gloo lane gathers with),
        # the sources' addresses read and compared as the lane does every round. (A tree
        # older than the tables, run alternating with this bench, gets torch's floor twice.)
        tables = floor
        if _hostcopy is not None:
            addresses = list(map(torch.Tensor.data_ptr, ordered))
            size = 16 * wire.itemsize
            gather = _hostcopy.HostGather.build(
                buf, range(0, total, size), [size] * n, addresses,
                (torch.float32, [wire] * n) if args.tiny_masters else None)
            assert gather is not None and not gather.rest

            async def tables() -> None:
                if list(map(torch.Tensor.data_ptr, ordered)) != addresses:
                    raise AssertionError("the tiny sources moved")
                gather.run(buf)
                dist.send(buf, tiny_worker)

        # The engine's own per-round fast pass (dtypes, shapes, device, contiguity) over the
        # same tensors, as each side runs it once per round: what no check can go below.
        from m2n_async._engine import _sources as _sources_mod
        from m2n_async._engine._sources import _INLINE_PARAMS, device_predicates, laid_out
        on_cpu = device_predicates("cpu")[1]
        shapes = [t.shape for t in ordered]
        dtypes = [t.dtype for t in ordered]

        def check() -> None:
            assert all(map(operator.is_, map(operator.attrgetter("dtype"), ordered), dtypes))
            assert laid_out(ordered, shapes, on_cpu)

        # What a round runs instead once a chunk has passed: one C-level re-check per chunk
        # (an older tree has none: the fast pass again).
        recheck_of = getattr(_sources_mod, "Recheck", None)
        chunks = [tuple(ordered[a:a + _INLINE_PARAMS]) for a in range(0, n, _INLINE_PARAMS)]
        rc = recheck_of() if recheck_of is not None else None
        if rc is not None:
            for a, ts in enumerate(chunks):
                rc.passed(a, ts)

        def recheck() -> None:
            if rc is None:
                return check()
            assert all(rc.passes(a, ts) for a, ts in enumerate(chunks))
    else:
        targets = {s.name: (torch.zeros(16, dtype=wire), None) for s in specs}
        engine = await WorkerEngine.connect(
            args.address, token=args.token, rank=1, trainer_ranks=1, world_size=2,
            mesh_dims=(1, 1), targets=targets, config=config, timeout=600)

        async def op() -> Any:
            return await engine.receive(timeout=300)
        buf = torch.empty(total, dtype=torch.uint8)
        dsts = [t for t, _ in targets.values()]
        srcs = list(buf.view(wire).view(n, 16).unbind(0))

        async def raw() -> None:
            dist.recv(buf, TINY_TRAINER)

        async def floor() -> None:  # the receive, then one multi-tensor copy into the targets
            dist.recv(buf, TINY_TRAINER)
            torch._foreach_copy_(dsts, srcs)

        tables = floor
        if _hostcopy is not None:
            scatter, left = _hostcopy.HostScatter.build(
                buf, range(0, total, 16 * wire.itemsize), [t.view(torch.uint8) for t in dsts])
            assert scatter is not None and not left

            async def tables() -> None:  # the receive, then the scatter through a table
                dist.recv(buf, TINY_TRAINER)
                scatter.run(buf)
    out.tiny_connect_s = time.perf_counter() - t0

    try:
        out.tiny_first_s = (await _timed(op, None, sub))[0]
        await _timed(raw, None, sub)
        for _ in range(args.tiny_rounds):
            seconds, res = await _timed(op, lag, sub)
            out.tiny_engine_s.append(seconds)
            out.tiny_phases = dict(res.phases)
            out.tiny_raw_s.append((await _timed(raw, None, sub))[0])
            out.tiny_floor_s.append((await _timed(floor, None, sub))[0])
            out.tiny_table_s.append((await _timed(tables, None, sub))[0])
            if rank == TINY_TRAINER:
                began = time.perf_counter()
                check()
                out.tiny_check_s.append(time.perf_counter() - began)
                began = time.perf_counter()
                recheck()
                out.tiny_recheck_s.append(time.perf_counter() - began)
    finally:
        await engine.close()


# -- the parent ------------------------------------------------------------------------------


def _p99(samples: list[float]) -> float:
    if not samples:
        return float("nan")
    s = sorted(samples)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def _run(ns: argparse.Namespace) -> list[RankFigures]:
    """Every rank's figures; exits naming the ranks that failed or overran ``--timeout``."""
    from m2n_async.testing import LocalWorld, WorldHangError

    # The world's processes start (and import torch) here, before any rank's clock runs.
    with tempfile.TemporaryDirectory() as tmp, \
            LocalWorld(ns.trainers, ns.workers, job_prefix="bench") as world:
        args = Args(ns.size_mb, ns.rounds, ns.tiny_params, ns.tiny_rounds, ns.bucket_mb,
                    world.address, world.token, os.path.join(tmp, "pg"), ns.profile,
                    ns.parts, ns.max_inflight, ns.trainers, ns.workers,
                    api_marks=ns.api_marks, tiny_masters=ns.tiny_masters)
        try:
            res = world.run(_bench_rank, kwargs={"args": args}, timeout=ns.timeout,
                            fail_grace=_FAIL_GRACE)
        except WorldHangError as exc:
            stuck = [r.rank for r in exc.results if r.status == "killed"]
            raise SystemExit(f"bench did not finish within {ns.timeout:g} s; ranks {stuck} "
                             f"still running (killed)") from None
    failed = [r for r in res if not r.ok]
    if failed:
        print("FAILED:\n  " + "\n  ".join(f"rank {r.rank}: {_failure(r)}" for r in failed),
              file=sys.stderr)
        raise SystemExit(1)
    return [r.value for r in res]


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _failure(r: WorldRank) -> str:
    """How a rank that returned no figures ended."""
    if r.status == "error":
        return f"{type(r.error).__name__}: {r.error}"
    if r.status == "dead":
        return f"died without a result (exit code {r.exitcode})"
    return f"still running {_FAIL_GRACE:g} s after the first failure (killed)"


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` > 0."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _parts(text: str) -> tuple[str, ...]:
    """``--parts``: comma-separated names of ``PARTS``, returned in the order they run."""
    given = [p.strip() for p in text.split(",")]
    bad = [p for p in given if p not in PARTS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown part {', '.join(map(repr, bad))}; the parts are {', '.join(PARTS)} "
            f"(comma-separated, e.g. --parts aligned,tiny)")
    return tuple(p for p in PARTS if p in given)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0].replace("``", ""))
    pos_int, pos_float = _positive(int), _positive(float)
    tiny = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in TINY.items())

    def preset(key: str) -> str:
        return f"(default {FULL[key]:g}; --tiny: {TINY[key]:g})"

    ap.add_argument("--size-mb", type=pos_float, default=None,
                    help=f"part 1's model size in MB (the demo model) {preset('size_mb')}")
    ap.add_argument("--rounds", type=pos_int, default=None,
                    help=f"timed rounds of part 1, each of engine, raw and raw + copies "
                         f"{preset('rounds')}")
    ap.add_argument("--tiny-params", type=pos_int, default=None,
                    help=f"part 2's tiny parameters, 64 B each {preset('tiny_params')}")
    ap.add_argument("--tiny-rounds", type=pos_int, default=None,
                    help=f"timed rounds of part 2 {preset('tiny_rounds')}")
    ap.add_argument("--tiny-masters", action="store_true",
                    help="part 2 moves bf16 parameters from fp32 master shards (the trainer "
                         "casts while packing; default: fp32 shards and wire)")
    ap.add_argument("--bucket-mb", type=pos_float, default=64.0,
                    help="EngineConfig.bucket_bytes, in MiB (default %(default)g)")
    ap.add_argument("--max-inflight", type=pos_int, default=3,
                    help="EngineConfig.max_inflight (default %(default)s, the engine's)")
    ap.add_argument("--timeout", type=pos_float, default=900.0,
                    help="seconds the whole run may take before its ranks are killed "
                         "(default %(default)g)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="cProfile every rank process (main thread) into DIR/rankN.prof "
                         "(default: off)")
    ap.add_argument("--api-marks", metavar="DIR", default=None,
                    help="record every rank's sync_weights/receive steps into DIR and print "
                         "their timeline per part at the end (bench/api_marks.py; default: "
                         "off)")
    ap.add_argument("--parts", type=_parts, default=tuple(PARTS),
                    help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: "
                         f"all); each keeps its number ({', '.join(PARTS.values())})")
    ap.add_argument("--trainers", type=pos_int, default=2,
                    help="trainer processes (default %(default)s)")
    ap.add_argument("--workers", type=pos_int, default=2,
                    help="worker processes (default %(default)s)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"toy sizes, the test suite's smoke run: {tiny}; a flag given "
                         f"beside it wins (default: off, full sizes)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with ``--size-mb``, ``--rounds``, ``--tiny-params`` and ``--tiny-rounds``
    taken from ``FULL`` or, with ``--tiny``, ``TINY`` where not given."""
    ns = build_parser().parse_args(argv)
    for key, value in (TINY if ns.tiny else FULL).items():
        if getattr(ns, key) is None:
            setattr(ns, key, type(FULL[key])(value))
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    import torch

    print(f"cpu_sync_bench: {ns.trainers} trainers + {ns.workers} workers, 1 torch thread each; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; Python "
          f"{platform.python_version()}, torch {torch.__version__}")
    print(f"settings: EngineConfig(transport='gloo', bucket_bytes={ns.bucket_mb:g} MiB, "
          f"max_inflight={ns.max_inflight}); parts {', '.join(ns.parts)}"
          f"{' (--tiny sizes)' if ns.tiny else ''}; timeout {ns.timeout:g} s")
    res = _run(ns)
    bad = {(r.rank, t.layout): t.mismatched for r in res for t in r.throughput if t.mismatched}
    if bad:
        print(f"FAILED: tensors not bit-exact after the throughput rounds: {bad}",
              file=sys.stderr)
        return 1
    lags: list[tuple[str, list[float]]] = []
    for i, t0 in enumerate(res[0].throughput):
        moved = sum(r.throughput[i].bytes_moved for r in res[ns.trainers:])
        eng, raw = statistics.median(t0.engine_s), statistics.median(t0.raw_s)
        what = ("the demo model's layouts (reshards: pieces packed)" if t0.layout == "mixed"
                else "every tensor placed alike on both meshes (zero-copy pieces)")
        part = PARTS[t0.layout]
        print(f"\n{part}. throughput, {t0.layout}: {what}; {ns.size_mb:g} MB model, "
              f"{moved / 1e6:.1f} MB into the workers per round, bucket {ns.bucket_mb:g} MiB, "
              f"max_inflight {ns.max_inflight}, {_n(ns.rounds, 'round')} each, interleaved")
        print(f"   sync_weights : median {eng:.3f} s = {moved / eng / 1e9:.2f} GB/s "
              f"(min {min(t0.engine_s):.3f} s)")
        print(f"   raw gloo p2p : median {raw:.3f} s = {moved / raw / 1e9:.2f} GB/s "
              f"(min {min(t0.raw_s):.3f} s)")
        rc = statistics.median(t0.raw_copy_s)
        mb = ", ".join(f"{r.throughput[i].copy_mb:.1f}" for r in res)
        print(f"   raw + the engine's packing copies (serial; MB copied by process: {mb}): "
              f"median {rc:.3f} s = {moved / rc / 1e9:.2f} GB/s (engine / this: "
              f"{rc / eng:.2f}x)")
        print("   each rank's last round (s; busy times overlap) and peak extra memory:")
        for k, rr in enumerate(res):
            tp = rr.throughput[i]
            ph = ", ".join(f"{name} {v:.3f}" for name, v in tp.phases.items())
            print(f"     rank {k} ({'trainer' if k < ns.trainers else 'worker'}): {ph}; "
                  f"peak {tp.peak_mb:.2f} MB")
        cpu = []
        for r in res:
            t = r.throughput[i]
            u, sy = (statistics.median(x[j] for x in t.cpu) * 1e3 for j in (0, 1))
            ru, rs = (statistics.median(x[j] for x in t.cpu_raw) * 1e3 for j in (0, 1))
            cu, cs = (statistics.median(x[j] for x in t.cpu_copy) * 1e3 for j in (0, 1))
            cpu.append(f"{r.rank}: {u:.0f}+{sy:.0f} / {ru:.0f}+{rs:.0f} / {cu:.0f}+{cs:.0f}")
        print(f"   CPU ms per round, user+sys, engine / raw / raw+copies (median), by process: "
              f"{'; '.join(cpu)}")
        ratio = raw / eng
        print(f"   sync_weights / raw gloo ({t0.layout}): {ratio:.2f}x  (goal >= 0.9x) "
              f"{'OK' if ratio >= 0.9 else 'MISSED'}")
        lags += [(f"part {part} sync_weights rounds", t0.lag),
                 (f"part {part} raw rounds (control: Gloo on a thread)", t0.lag_raw),
                 (f"part {part} raw + copies rounds (control: on a thread)", t0.lag_copy)]

    if "tiny" in ns.parts:
        n = ns.tiny_params
        t_eng = statistics.median(res[TINY_TRAINER].tiny_engine_s)
        t_raw = statistics.median(res[TINY_TRAINER].tiny_raw_s)
        per = (t_eng - t_raw) / n
        what = ("16 x bf16 = 32 B each on the wire, fp32 masters cast while packing"
                if ns.tiny_masters else "16 x fp32 = 64 B each")
        print(f"\n{PARTS['tiny']}. {n:,} tiny params ({what}), 1 trainer -> 1 "
              f"worker, bucket {ns.bucket_mb:g} MiB, max_inflight {ns.max_inflight}, "
              f"{_n(ns.tiny_rounds, 'round')} (connect incl. handshake: "
              f"{res[TINY_TRAINER].tiny_connect_s:.2f} s; first round: "
              f"{res[TINY_TRAINER].tiny_first_s:.2f} s)")
        print(f"   sync_weights : median {t_eng:.3f} s;  raw gloo of the same "
              f"{n * (32 if ns.tiny_masters else 64) / 1e6:.1f} MB: median {t_raw:.4f} s")
        print(f"   host overhead per parameter: {per * 1e6:.2f} us  (goal <= "
              f"{OVERHEAD_GOAL_S * 1e6:g} us) {'OK' if per <= OVERHEAD_GOAL_S else 'MISSED'}  "
              f"(stretch goal <= {OVERHEAD_STRETCH_S * 1e6:g} us) "
              f"{'OK' if per <= OVERHEAD_STRETCH_S else 'MISSED'}")
        t_floor = statistics.median(res[TINY_TRAINER].tiny_floor_s)
        print(f"   raw gloo + one torch.cat pack + one torch._foreach_copy_ unpack of "
              f"the same tensors, no checks: median {t_floor:.4f} s = "
              f"{(t_floor - t_raw) / n * 1e6:.2f} us per parameter over raw")
        t_table = statistics.median(res[TINY_TRAINER].tiny_table_s)
        print(f"   floor: raw gloo + the same copies through address tables (a HostGather "
              f"pack, its addresses compared, and a HostScatter unpack), no checks: median "
              f"{t_table:.4f} s = {(t_table - t_raw) / n * 1e6:.2f} us per parameter over "
              f"raw; the engine beyond it: {(t_eng - t_table) / n * 1e6:.2f} us")
        t_check = statistics.median(res[TINY_TRAINER].tiny_check_s)
        t_recheck = statistics.median(res[TINY_TRAINER].tiny_recheck_s)
        print(f"   the engine's checks alone, each side's once per round: the fast pass (dtype, "
              f"shape, device, contiguity) {t_check / n * 1e6:.2f} us per parameter; the "
              f"re-check of chunks that passed (one TensorGuards call each, every round after "
              f"the first) {t_recheck / n * 1e6:.2f} us")
        for who, rr in (("trainer", res[TINY_TRAINER]), ("worker", res[ns.trainers])):
            ph = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rr.tiny_phases.items())
            print(f"   {who} phases of the last round, ms: {ph}")

        lags.append((f"part {PARTS['tiny']} sync_weights rounds", res[TINY_TRAINER].lag_tiny))
    print("\n3. event-loop lag on trainer rank 0 (a task sleeping 1 ms; how late it wakes)")
    for label, samples in lags:
        print(f"   during {label}: p99 {_p99(samples) * 1e3:.2f} ms, max "
              f"{max(samples, default=0) * 1e3:.2f} ms ({len(samples)} samples)")
    worst = max(_p99(v) for k, v in lags if "control" not in k)
    print(f"   event-loop lag p99 (worst sync_weights part): {worst * 1e3:.2f} ms  "
          f"(goal <= 5 ms) {'OK' if worst <= 5e-3 else 'MISSED'}")
    if ns.api_marks:
        import api_marks

        print(f"\n4. the public API's steps, by part (bench/api_marks.py, {ns.api_marks})")
        print(api_marks.summarize(ns.api_marks, skip=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
