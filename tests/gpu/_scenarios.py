"""Per-rank scenarios for the GPU tests (run in spawned processes by ``_world.run_world``)."""

from __future__ import annotations

import os
import time
from typing import Any

from m2n_async.testing._gpu import (
    LAYOUTS,
    TINY_MIXED,
    LagMonitor,
    R,
    RankCtx,
    back_to_back,
    close_transport,
    coalesce_layout_defs,
    expected_shards,
    layout_defs,
    make_plan,
    mismatches,
    mixed_defs,
    open_transport,
    run_round,
    source_shards,
    zero_targets,
)


async def planes(ctx: RankCtx) -> dict[str, Any]:
    """Every layout pair of the topology through each transport, ``rounds`` rounds, checked
    bit-exact on the workers; byte counts vs the plan; event-loop lag while syncing."""
    import anyio

    case = ctx.case
    src_dims, dst_dims, _ = LAYOUTS[case["topology"]]
    out: dict[str, Any] = {}
    for name in case["transports"]:
        variants = [("", None, layout_defs(case["topology"], name))]
        if case.get("cast"):
            bf16 = [d for d in layout_defs(case["topology"], name) if d[2] == "bfloat16"]
            variants.append(("+fp32src", "float32", bf16))
        for suffix, src_dtype, defs in variants:
            plan = make_plan(defs, src_dims, dst_dims)
            tag = f"{name}{suffix}"
            t = await open_transport(ctx, name, plan, bucket_bytes=case["bucket_bytes"],
                                     max_inflight=case.get("max_inflight", 2), tag=tag)
            rec: dict[str, Any] = {"buckets": len(t.ctx.buckets), "moved": [], "bad": [],
                                   "seconds": []}
            if name == "m2n":
                rec["grouped"] = t.grouped
                rec["grouping_reason"] = t.grouping_reason
            targets = (zero_targets(plan, ctx.rank, ctx.device)
                       if ctx.rank >= ctx.trainer_ranks else None)
            lag = LagMonitor()
            try:
                for rnd in range(case.get("rounds", 2)):
                    trainer = ctx.rank < ctx.trainer_ranks
                    sources = (source_shards(plan, ctx.rank, rnd, ctx.device, src_dtype)
                               if trainer else None)
                    await ctx.barrier(f"{tag}-{rnd}")
                    stop = anyio.Event()
                    t0 = time.perf_counter()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(lag.run, stop)
                        stats = await run_round(t, round=rnd, deadline_s=60.0,
                                                sources=sources,
                                                sinks=None if trainer else targets)
                        stop.set()
                    rec["seconds"].append(round(time.perf_counter() - t0, 4))
                    rec["moved"].append(stats.nbytes)
                    rec["peak_extra_bytes"] = stats.peak_extra_bytes
                    if not trainer:
                        want = expected_shards(plan, ctx.rank, rnd, ctx.device)
                        rec["bad"].append(mismatches(targets, want))
                rec["plan_bytes"] = (plan.send_bytes(ctx.rank) if ctx.rank < ctx.trainer_ranks
                                     else plan.recv_bytes(ctx.rank))
                rec["lag_max_ms"] = round(lag.max_lag * 1e3, 3)
                rec["lag_samples"] = lag.samples
            finally:
                rec.update(await close_transport(t))
            out[tag] = rec
    return out


def coalesce_plan(case: dict[str, Any]) -> Any:
    """The plan of a ``coalesce_planes`` case: the suite's layout pairs with repeats, or a
    tiny mixed (MoE-like) model on 2+2: stackable groups, rank-3 tensors, replicated targets
    and parameters above a low ``coalesce_below``."""
    if case["plan"] == "mixed":
        src_dims, dst_dims, _ = LAYOUTS["2+2"]
        return make_plan(mixed_defs(**TINY_MIXED), src_dims, dst_dims)
    src_dims, dst_dims, _ = LAYOUTS[case["topology"]]
    return make_plan(coalesce_layout_defs(case["topology"]), src_dims, dst_dims)


async def coalesce_planes(ctx: RankCtx) -> dict[str, Any]:
    """The ``m2n`` lane with coalescing on and off (``case["variants"]``: tag, coalesce,
    coalesce_below or None, bucket_bytes, source dtype or None), two rounds of different bytes
    each, every worker byte checked; byte counts vs the plan; the calls the lane should issue
    (``_proto.stacking.bucket_calls``) next to the parameter count."""
    import torch

    from m2n_async._data._kernels import compiled_variants
    from m2n_async._proto.stacking import COALESCE_BELOW_BYTES, bucket_calls

    plan = coalesce_plan(ctx.case)
    trainer = ctx.rank < ctx.trainer_ranks
    out: dict[str, Any] = {}
    for tag, coalesce, below, bucket_bytes, src_dtype in ctx.case["variants"]:
        t = await open_transport(ctx, "m2n", plan, bucket_bytes=bucket_bytes, max_inflight=2,
                                 tag=f"co-{tag}", coalesce=coalesce, coalesce_below=below)
        thr = COALESCE_BELOW_BYTES if below is None else below
        rec: dict[str, Any] = {
            "params": len(plan.params), "buckets": len(t.ctx.buckets), "moved": [], "bad": [],
            "calls": len(plan.params),
            # the Triton copy's variants after connect (which warms the lane's forms) and
            # after the rounds: equal unless a round compiled one
            "variants": [compiled_variants()]}
        targets = None if trainer else zero_targets(plan, ctx.rank, ctx.device)
        # "flat": sources and targets as views of one buffer, each stack's members back to
        # back (a flat parameter buffer): the lane reshards those stacks in place
        flat = ctx.case.get("flat", False)
        calls = [call for b in t.ctx.buckets
                 for call in bucket_calls(plan, b, coalesce_below=thr, max_call_bytes=2 << 30)]
        rec["stacked_calls"] = sum(len(c) > 1 for c in calls) if coalesce else 0
        if coalesce:
            rec["calls"] = len(calls)
        order = [[plan.params[i].spec.name for i in c] for c in calls] if flat else []
        if targets is not None and flat:
            targets = back_to_back(targets, order, ctx.device)
        flat_sources: dict[str, Any] | None = None
        stagings: list[Any] = []
        stage = t.stage

        async def counted(bucket: Any, stage: Any = stage, stagings: list[Any] = stagings,
                          **kw: Any) -> Any:
            st = await stage(bucket, **kw)
            stagings.append(st)
            return st

        t.stage = counted
        old: list[Any] = []  # moved targets' old storage, kept: a stale write stays visible
        try:
            for rnd in range(2):
                if targets is not None and rnd == 1 and ctx.case.get("move_targets"):
                    for v in targets.values():  # new storage behind the same tensors
                        old.append(v.data)
                        v.data = torch.zeros_like(v)
                sources = (source_shards(plan, ctx.rank, rnd, ctx.device, src_dtype)
                           if trainer else None)
                if sources is not None and flat:  # refilled in place, as an optimizer does
                    if flat_sources is None:
                        flat_sources = back_to_back(sources, order, ctx.device)
                    for name, v in flat_sources.items():
                        v.copy_(sources[name])
                    sources = flat_sources
                await ctx.barrier(f"co-{tag}-{rnd}")
                del stagings[:]
                stats = await run_round(t, round=rnd, deadline_s=60.0, sources=sources,
                                        sinks=targets)
                rec.setdefault("in_place_stacks", []).append(
                    sum(st.in_place_stacks for st in stagings))
                rec["moved"].append(stats.nbytes)
                if not trainer:
                    want = expected_shards(plan, ctx.rank, rnd, ctx.device)
                    rec["bad"].append(mismatches(targets, want))
            rec["plan_bytes"] = (plan.send_bytes(ctx.rank) if trainer
                                 else plan.recv_bytes(ctx.rank))
            rec["variants"].append(compiled_variants())
        finally:
            rec.update(await close_transport(t))
        out[tag] = rec
    return out


async def grouping_on(ctx: RankCtx) -> dict[str, Any]:
    """``M2N_ASYNC_M2N_GROUPING=on`` on a host where grouping fails: connect must fail on
    every rank, promptly, without a hang."""
    plan = make_plan(layout_defs("1+1", "m2n")[:1], *LAYOUTS["1+1"][:2])
    t0 = time.monotonic()
    try:
        t = await open_transport(ctx, "m2n", plan, bucket_bytes=1 << 20, max_inflight=2,
                                 tag="on")
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc)[:400],
                "seconds": round(time.monotonic() - t0, 3)}
    res = {"connected": True, "grouped": t.grouped, "reason": t.grouping_reason}
    res.update(await close_transport(t))
    return res


async def kill(ctx: RankCtx) -> dict[str, Any]:
    """A worker dies after the communicator exists; survivors' rounds must end within the
    deadline (then abort, bounded close), never hang."""
    import anyio

    case = ctx.case
    name = case["transport"]
    src_dims, dst_dims, _ = LAYOUTS["2+2"]
    # A 512 MiB parameter (128 MiB from each trainer to each worker): on the H200 a 16 MiB one
    # still completed eagerly into a dead peer's NCCL buffers and the round "succeeded".
    defs = [*layout_defs("2+2", name)[:4], ("big", (16384, 8192), "float32", (R, 0), (R, 1))]
    plan = make_plan(defs, src_dims, dst_dims)
    t = await open_transport(ctx, name, plan, bucket_bytes=1 << 14, max_inflight=2,
                             tag=f"kill-{name}")
    trainer = ctx.rank < ctx.trainer_ranks
    sources = source_shards(plan, ctx.rank, 0, ctx.device) if trainer else None
    targets = None if trainer else zero_targets(plan, ctx.rank, ctx.device)
    # one good round first: connections exist, as in a job that ran for a while
    await ctx.barrier("warm")
    await run_round(t, round=0, deadline_s=60.0, sources=sources, sinks=targets)
    await ctx.barrier("before-kill")
    if ctx.rank in case["victims"]:
        os._exit(9)
    await anyio.sleep(0.5)
    deadline = case["deadline_s"]
    t0 = time.monotonic()
    outcome: dict[str, Any] = {}
    try:
        await run_round(t, round=1, deadline_s=deadline, sources=sources, sinks=targets)
        outcome["round"] = "completed"  # possible for a trainer whose sends were buffered
    except BaseException as exc:
        outcome["round"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        t.abort(f"round failed: {type(exc).__name__}")
    outcome["round_end_s"] = round(time.monotonic() - t0, 3)
    t.abort("test teardown")  # what the engine's watchdog does on every rank
    outcome.update(await close_transport(t))
    outcome["total_s"] = round(time.monotonic() - t0, 3)
    return outcome


async def engine(ctx: RankCtx) -> dict[str, Any]:
    """The public engine on the GPU: connect, two rounds, bit-exact, SyncResult figures."""
    import m2n_async

    case = ctx.case
    name = case["transport"]
    src_dims, dst_dims, _ = LAYOUTS[case["topology"]]
    defs = layout_defs(case["topology"], name)
    plan = make_plan(defs, src_dims, dst_dims)
    cfg = m2n_async.EngineConfig(transport=name, bucket_bytes=case["bucket_bytes"],
                                 max_inflight=2, device=str(ctx.device), phase_timeout=60.0,
                                 round_timeout=60.0, job=f"eng-{name}")
    out: dict[str, Any] = {}
    if ctx.rank < ctx.trainer_ranks:
        eng = await m2n_async.TrainerEngine.connect(
            ctx.address, token="m2n-gpu-test", rank=ctx.rank, trainer_ranks=ctx.trainer_ranks,
            world_size=ctx.world_size, params=[p.spec for p in plan.params], config=cfg)
        try:
            for rnd in range(2):
                res = await eng.sync_weights(source_shards(plan, ctx.rank, rnd, ctx.device))
                out[f"round{rnd}"] = _result(res)
        finally:
            await eng.close()
    else:
        targets = zero_targets(plan, ctx.rank, ctx.device)
        spec = {p.spec.name: (targets[p.spec.name], p.dst.placements) for p in plan.params}
        eng = await m2n_async.WorkerEngine.connect(
            ctx.address, token="m2n-gpu-test", rank=ctx.rank, trainer_ranks=ctx.trainer_ranks,
            world_size=ctx.world_size, targets=spec, mesh_dims=dst_dims, config=cfg)
        try:
            for rnd in range(2):
                res = await eng.receive(timeout=60)
                out[f"round{rnd}"] = _result(res)
                out[f"bad{rnd}"] = mismatches(targets, expected_shards(plan, ctx.rank, rnd,
                                                                       ctx.device))
        finally:
            await eng.close()
    out["plan_bytes"] = (plan.send_bytes(ctx.rank) if ctx.rank < ctx.trainer_ranks
                         else plan.recv_bytes(ctx.rank))
    return out


def _result(res: Any) -> dict[str, Any]:
    return {"version": res.version, "bytes": res.bytes, "seconds": round(res.seconds, 4),
            "transport": res.transport, "reason": res.reason, "buckets": res.buckets,
            "peak_extra_bytes": res.peak_extra_bytes,
            "phases": {k: round(v, 4) for k, v in res.phases.items()}}
