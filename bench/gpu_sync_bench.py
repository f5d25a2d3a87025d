"""GPU sync benchmark: the engine's bucket pipeline vs per-parameter M2N vs raw M2N, side by side.

One spawned world (``--trainers`` + ``--workers`` ranks, 2 + 2 by default; trainers
``Shard(0)`` on mesh (1,T) → workers ``Shard(1)`` on mesh (1,N)) runs, on the same
communicator and the same tensors, in one process run. On one GPU every rank shares it
(libnccl >= 2.30); on several, trainers take the first half of the GPUs and workers the second
half (``tests/gpu/_world.gpu_of``), and the summary adds GB/s per receiving GPU and the
efficiency against ``--link-gbps`` (370 GB/s, NCCL's effective NVLink rate on H200):

* ``raw``       — the same ``nccl.m2n`` reshards back to back on one stream, one sync at the end
                  (zero-copy buffers prepared up front): the floor the engine is measured against;
* ``per_param`` — vLLM-style: one reshard per parameter and a stream sync after each (no
                  grouping, no overlap);
* ``m2n``       — the ``m2n`` transport through the engine's bucket pipeline (``run_pipeline``);
* ``nccl``      — the ``nccl`` transport (packed per-peer buffers, grouped send/recv);
* ``m2n_cast``  — ``m2n`` with fp32 master sources cast to the bf16 wire inside the pipeline,
                  next to ``pack_only`` (the casts alone) — the overlap check:
                  sync <= 1.1 x max(pack, transfer).

Each figure is the median over ``--iters`` timed iterations (after one warm-up) of the slowest
rank's wall time from a common store barrier to its own completion. On one GPU shared by all
ranks the absolute GB/s mean little (DEVELOPERS "GPU notes"); the ratios are the point.
Buckets default to 256 MiB (the GPU transports' default ``bucket_bytes``).

    python bench/gpu_sync_bench.py --model moe --out bench-gpu.json
    python bench/gpu_sync_bench.py --model large --trainers 2 --workers 2 --diagnose --broadcast
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu import _world  # noqa: E402 - after the path fix above

MODELS = {
    # many small tensors (MoE experts): per-call overhead dominates
    "moe": {"n": 1024, "shape": (512, 256)},
    # a few large tensors
    "dense": {"n": 16, "shape": (4096, 4096)},
    # large tensors, 4 GiB in all: the NVLink-bandwidth figure (issue 7)
    "large": {"n": 32, "shape": (8192, 8192)},
}


def _defs(model: str) -> list[tuple[str, tuple[int, ...], str, Any, Any]]:
    m = MODELS[model]
    r = _world.R
    return [(f"layers.{i}.w", tuple(m["shape"]), "bfloat16", (r, 0), (r, 1))
            for i in range(m["n"])]


async def bench_rank(ctx: _world.RankCtx) -> dict[str, Any]:
    import torch

    case = ctx.case
    plan = _world.make_plan(_defs(case["model"]), (1, ctx.trainer_ranks),
                            (1, ctx.world_size - ctx.trainer_ranks))
    trainer = ctx.rank < ctx.trainer_ranks
    dev = ctx.device
    iters = case["iters"]
    sources = _world.source_shards(plan, ctx.rank, 0, dev) if trainer else None
    sources32 = ({k: v.float() for k, v in sources.items()} if sources is not None else None)
    targets = None if trainer else _world.zero_targets(plan, ctx.rank, dev)
    out: dict[str, Any] = {"bytes": plan.send_bytes(ctx.rank) if trainer
                           else plan.recv_bytes(ctx.rank),
                           "gpu": dev.index, "gpu_name": torch.cuda.get_device_name(dev)}

    async def timed_interleaved(paths: dict[str, Any], n: int | None = None) -> None:
        # A B C A B C ...: on the x2 host the per-call cost of M2N drifted between paths run
        # one after another (MoE 1+1: raw 49 ms first, the same raw calls 78-80 ms later), so
        # the headline ratios come from paths that share every iteration's conditions
        times: dict[str, list[float]] = {k: [] for k in paths}
        for it in range((iters if n is None else n) + 1):
            for name, fn in paths.items():
                await ctx.barrier(f"{name}-{it}")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await fn()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            out[name] = ts[1:]

    async def timed(name: str, fn: Any, n: int | None = None) -> None:
        await timed_interleaved({name: fn}, n)

    t = await _world.open_transport(ctx, "m2n", plan, bucket_bytes=case["bucket_bytes"],
                                    max_inflight=case["max_inflight"],
                                    max_cta=case.get("max_cta"), tag="bench-m2n")
    out["grouping"] = t.grouping_reason
    m2n = t._m2n
    stream = torch.cuda.Stream()
    descs = []
    for i in range(len(plan.params)):
        p = t._describe(i)
        name = p.name
        src = m2n.DistTensor(sources[name] if trainer else None, p.src_shape, p.dtype,
                             mesh=p.src_mesh, placements=p.src_placements)
        dst = m2n.DistTensor(None if trainer else targets[name], p.dst_shape, p.dtype,
                             mesh=p.dst_mesh, placements=p.dst_placements)
        descs.append((src, dst))

    def raw_calls(sync_each: bool, s: Any = stream) -> None:
        sptr = s.cuda_stream
        for src, dst in descs:
            t.handle.reshard(t.comm, src, dst, stream=sptr)
            if sync_each:
                s.synchronize()
        s.synchronize()

    def raw_build() -> None:
        # like ``raw`` but building the descriptors per call, as the transport does
        sptr = stream.cuda_stream
        for i in range(len(plan.params)):
            p = t._describe(i)
            src = m2n.DistTensor(sources[p.name] if trainer else None, p.src_shape, p.dtype,
                                 mesh=p.src_mesh, placements=p.src_placements)
            dst = m2n.DistTensor(None if trainer else targets[p.name], p.dst_shape, p.dtype,
                                 mesh=p.dst_mesh, placements=p.dst_placements)
            t.handle.reshard(t.comm, src, dst, stream=sptr)
        stream.synchronize()

    async def raw() -> None:
        await t.ctx.native.run(raw_calls, False)

    async def per_param() -> None:
        await t.ctx.native.run(raw_calls, True)

    rnd = [0]

    async def pipeline(tr: Any, srcs: Any) -> None:
        rnd[0] += 1
        await _world.run_round(tr, round=rnd[0], deadline_s=300.0, sources=srcs,
                               sinks=targets)
        if trainer:
            # trainer ends when its sends were handed over; match the raw path's full sync
            torch.cuda.synchronize()

    await timed_interleaved({"raw": raw, "per_param": per_param,
                             "m2n": lambda: pipeline(t, sources)})
    if case.get("diagnose"):
        async def raw_tstream() -> None:
            await t.ctx.native.run(raw_calls, False, t.streams.transfer)

        async def raw_built() -> None:
            await t.ctx.native.run(raw_build)

        def raw_after_default() -> None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            stream.wait_event(ev)
            raw_calls(False)

        async def raw_default_dep() -> None:
            await t.ctx.native.run(raw_after_default)

        await timed("raw_after_default_stream_event", raw_default_dep)
        await timed("raw_transfer_stream", raw_tstream)
        await timed("raw_build_descs", raw_built)
        # one traced pipeline round: per bucket, enqueue time on the native thread and
        # time until its completion fired
        trace: list[dict[str, float]] = []
        orig = t.transfer

        def traced(st: Any) -> Any:
            t_sub = time.perf_counter()
            c = orig(st)
            rec = {"bucket": st.bucket.index, "params": st.bucket.stop - st.bucket.start,
                   "submit": t_sub}
            trace.append(rec)
            c.signal.add_done_callback(lambda _s: rec.__setitem__("done", time.perf_counter()))
            return c

        t.transfer = traced  # type: ignore[method-assign]
        await ctx.barrier("trace")
        t_start = time.perf_counter()
        await pipeline(t, sources)
        t.transfer = orig  # type: ignore[method-assign]
        out["trace"] = [{k: (round(v - t_start, 4) if k in ("submit", "done") else v)
                         for k, v in r.items()} for r in trace]
    if case.get("diagnose"):
        # the first path again, after everything else on this communicator: drift shows here
        await timed("raw_again", raw)
    await timed("m2n_cast", lambda: pipeline(t, sources32))
    if case.get("diagnose"):
        # the same casts with one fence per bucket (before m2n.GATE_BYTES): every reshard of
        # a bucket waits for all of the bucket's casts
        from m2n_async._data import m2n as m2n_plane

        saved_gate = m2n_plane.GATE_BYTES
        m2n_plane.GATE_BYTES = 1 << 62
        try:
            await timed("m2n_cast_one_fence", lambda: pipeline(t, sources32))
        finally:
            m2n_plane.GATE_BYTES = saved_gate

    async def pack_only() -> None:
        if sources32 is not None:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                keep = [v.to(torch.bfloat16) for v in sources32.values()]
            s.synchronize()
            del keep

    await timed("pack_only", pack_only)
    if not trainer:
        out["bad_m2n"] = _world.mismatches(targets, _world.expected_shards(plan, ctx.rank, 0,
                                                                           dev))
    if case.get("timeline"):
        await ctx.barrier("timeline-m2n")
        out["timeline_m2n"] = await traced_round(t, sources, pipeline)
    out.update({f"m2n_{k}": v for k, v in (await _world.close_transport(t)).items()})

    if case.get("diagnose"):
        for tag, env, bb, mi in (
                ("m2n_blocking_events", {"M2N_ASYNC_CUDA_EVENT": "blocking",
                                         "M2N_ASYNC_CUDA_COMPLETION": "watch"}, None, None),
                ("m2n_poll_events", {"M2N_ASYNC_CUDA_COMPLETION": "poll"}, None, None),
                ("m2n_bucket_64MiB", {}, 64 << 20, None),
                ("m2n_bucket_1GiB", {}, 1 << 30, None),
                ("m2n_one_bucket", {}, 1 << 40, 1)):
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            tv = await _world.open_transport(
                ctx, "m2n", plan, bucket_bytes=bb or case["bucket_bytes"],
                max_inflight=mi or case["max_inflight"], tag=f"bench-{tag}")
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            await timed(tag, lambda tv=tv: pipeline(tv, sources))
            await _world.close_transport(tv)

    tn = await _world.open_transport(ctx, "nccl", plan, bucket_bytes=case["bucket_bytes"],
                                     max_inflight=case["max_inflight"], tag="bench-nccl")
    if targets is not None:
        for v in targets.values():
            v.zero_()
    await timed("nccl", lambda: pipeline(tn, sources))
    if not trainer:
        out["bad_nccl"] = _world.mismatches(targets, _world.expected_shards(plan, ctx.rank, 0,
                                                                            dev))
    if case.get("timeline"):
        await ctx.barrier("timeline-nccl")
        out["timeline_nccl"] = await traced_round(tn, sources, pipeline)
    await _world.close_transport(tn)

    if case.get("broadcast"):
        try:
            out.update(await broadcast_baseline(ctx, plan, sources, targets, timed))
        except Exception as exc:
            out["broadcast_error"] = f"{type(exc).__name__}: {exc}"[:500]

    for k, (bb, mi, cta) in enumerate(case.get("sweep", [])):
        try:
            ts = await _world.open_transport(ctx, "m2n", plan, bucket_bytes=bb, max_inflight=mi,
                                             max_cta=cta, tag=f"sweep-{k}")
            await timed(f"sweep_{k}", lambda ts=ts: pipeline(ts, sources), n=1)
            out[f"sweep_{k}_config"] = {"bucket_bytes": bb, "max_inflight": mi, "max_cta": cta,
                                        "buckets": len(ts.ctx.buckets)}
            await _world.close_transport(ts)
        except Exception as exc:
            out[f"sweep_{k}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def traced_round(tr: Any, srcs: Any, pipeline: Any) -> list[dict[str, float]]:
    """One pipeline round with per-bucket stage / transfer / unpack times (loop clock)."""
    t0 = time.perf_counter()
    recs: dict[int, dict[str, float]] = {}

    def now() -> float:
        return round(time.perf_counter() - t0, 6)

    orig_stage, orig_transfer, orig_unpack = tr.stage, tr.transfer, tr.unpack

    async def stage(bucket: Any, **kw: Any) -> Any:
        r = recs.setdefault(bucket.index, {"bucket": bucket.index})
        r["pack0"] = now()
        st = await orig_stage(bucket, **kw)
        r["pack1"] = now()
        return st

    def transfer(st: Any) -> Any:
        r = recs[st.bucket.index]
        r["transfer0"] = now()
        c = orig_transfer(st)
        c.signal.add_done_callback(lambda _s: r.__setitem__("transfer1", now()))
        return c

    async def unpack(st: Any, sinks: Any) -> None:
        r = recs[st.bucket.index]
        r["unpack0"] = now()
        await orig_unpack(st, sinks)
        r["unpack1"] = now()

    tr.stage, tr.transfer, tr.unpack = stage, transfer, unpack
    try:
        await pipeline(tr, srcs)
    finally:
        del tr.stage, tr.transfer, tr.unpack  # back to the class methods
    return [recs[k] for k in sorted(recs)]


async def broadcast_baseline(ctx: _world.RankCtx, plan: Any, sources: Any, targets: Any,
                             timed: Any) -> dict[str, Any]:
    """vLLM's packed-broadcast backend, for this model: every other trainer sends its row
    shards to rank 0, rank 0 assembles the full tensors and broadcasts them in buckets (1 GiB
    as vLLM for models of 4 GiB or more, else 64 MiB so that double-buffering still happens)
    over all ranks, double-buffered on two streams; workers copy their column shard out of
    each bucket."""
    import torch

    tb = await _world.open_transport(ctx, "nccl", plan, bucket_bytes=1 << 20, max_inflight=1,
                                     tag="bench-bcast")
    comm, native = tb.comm, tb.ctx.native
    rank, dev = ctx.rank, ctx.device
    t_ranks, n_ranks = ctx.trainer_ranks, ctx.world_size - ctx.trainer_ranks
    names = [p.spec.name for p in plan.params]
    shape = tuple(plan.params[0].spec.shape)           # every param has the same shape here
    numel = shape[0] * shape[1]
    bucket = BCAST_BUCKET_LARGE if len(names) * numel * 2 >= 4 << 30 else BCAST_BUCKET
    per_bucket = max(1, bucket // (numel * 2))
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    bufs = [torch.empty(per_bucket * numel, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    rows, width = shape[0] // t_ranks, shape[1] // n_ranks
    cols = None if targets is None else (rank - t_ranks) * width

    def one_round() -> None:
        s0 = streams[0]
        full: list[Any] = []
        if 0 < rank < t_ranks:
            with torch.cuda.stream(s0):  # pack and send on one stream: no missing dependency
                mine = torch.cat([sources[n].reshape(-1) for n in names])
                comm.send(mine, 0, stream=s0.cuda_stream)
        if rank == 0:
            others = []
            for peer in range(1, t_ranks):
                other = torch.empty(len(names) * rows * shape[1], dtype=torch.bfloat16,
                                    device=dev)
                comm.recv(other, peer, stream=s0.cuda_stream)
                others.append(other.view(len(names), rows, shape[1]))
            with torch.cuda.stream(s0):
                full = [torch.cat([sources[n]] + [o[i] for o in others], dim=0)
                        for i, n in enumerate(names)]
        streams[1].wait_stream(s0)
        for k, a in enumerate(range(0, len(names), per_bucket)):
            b = min(a + per_bucket, len(names))
            s, buf = streams[k % 2], bufs[k % 2][:(b - a) * numel]
            if rank == 0:
                with torch.cuda.stream(s):
                    torch.cat([f.reshape(-1) for f in full[a:b]], out=buf)
            comm.broadcast(buf, buf, 0, stream=s.cuda_stream)
            if targets is not None:
                with torch.cuda.stream(s):
                    view = buf.view(b - a, shape[0], shape[1])
                    for i in range(a, b):
                        targets[names[i]].copy_(view[i - a][:, cols:cols + width])
        for s in streams:
            s.synchronize()

    async def bcast() -> None:
        await native.run(one_round)

    out: dict[str, Any] = {}
    if targets is not None:
        for v in targets.values():
            v.zero_()
    await timed("broadcast", bcast)
    if targets is not None:
        out["bad_broadcast"] = _world.mismatches(targets, _world.expected_shards(
            plan, ctx.rank, 0, dev))
    out["broadcast_bucket_params"] = per_bucket
    await _world.close_transport(tb)
    return out


BCAST_BUCKET = 64 << 20  # vLLM uses 1 GiB; the small models are 256-512 MiB: double-buffer
BCAST_BUCKET_LARGE = 1 << 30
NVLINK_GBPS = 370.0  # NCCL's effective NVLink bandwidth per H200 (REFERENCE.md)


def write_timeline_png(path: str, lanes: dict[str, list[dict[str, float]]]) -> None:
    """A dependency-free PNG: one row per (rank, stage), one box per bucket (pack blue,
    transfer orange, unpack green), time left to right."""
    import struct
    import zlib

    width, row_h, pad = 1200, 14, 2
    colors = {"pack": (52, 101, 164), "transfer": (245, 121, 0), "unpack": (78, 154, 6)}
    rows = [(label, stage) for label in lanes for stage in ("pack", "transfer", "unpack")]
    height = len(rows) * row_h + 2 * pad
    end = max((r.get(f"{st}1", 0.0) for recs in lanes.values() for r in recs
               for st in colors), default=1.0) or 1.0
    px = [[(255, 255, 255)] * width for _ in range(height)]
    for y_i, (label, stage) in enumerate(rows):
        y0 = pad + y_i * row_h
        for x in range(width):  # lane separator
            px[y0 + row_h - 1][x] = (225, 225, 225)
        prev_end = 0.0
        for k, r in enumerate(lanes[label]):
            a, b = r.get(f"{stage}0"), r.get(f"{stage}1")
            if a is None or b is None:
                continue
            if stage == "transfer":
                # submitted at a, but one stream runs the buckets' transfers one after another
                a = max(a, prev_end)
                prev_end = b
            x0 = int(a / end * (width - 1))
            x1 = max(x0 + 1, int(b / end * (width - 1)))
            c = colors[stage] if k % 2 == 0 else tuple(min(255, v + 60) for v in colors[stage])
            for y in range(y0 + 2, y0 + row_h - 3):
                for x in range(x0, min(x1, width)):
                    px[y][x] = c
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0,
                                                              0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


def summarize(run: dict[str, Any], trainer_ranks: int = 2,
              link_gbps: float = NVLINK_GBPS) -> dict[str, Any]:
    res = run["results"]
    errors = {r: v["error"] for r, v in res.items() if "error" in v}
    if errors:
        return {"errors": errors, "tracebacks": {r: v.get("traceback") for r, v in res.items()
                                                 if "error" in v}}
    names = [n for n in ("raw", "raw_after_default_stream_event", "raw_transfer_stream",
                         "raw_build_descs", "raw_again", "per_param", "m2n", "m2n_blocking_events",
                         "m2n_poll_events", "m2n_bucket_64MiB", "m2n_bucket_1GiB",
                         "m2n_one_bucket",
                         "nccl", "m2n_cast", "m2n_cast_one_fence", "pack_only", "broadcast")
             if n in res[0]]
    names += sorted((n for n in res[0] if n.startswith("sweep_") and n[6:].isdigit()),
                    key=lambda n: int(n[6:]))
    summary: dict[str, Any] = {}
    workers = [r for r in res if r >= trainer_ranks]
    nbytes = sum(res[r]["bytes"] for r in workers)
    # bytes into / out of each GPU; with trainers and workers on different GPUs every one of
    # them crosses NVLink, and the busiest GPU at ``link_gbps`` bounds the round from below
    gpu_in: dict[int, int] = {}
    gpu_out: dict[int, int] = {}
    for r, v in res.items():
        side = gpu_out if r < trainer_ranks else gpu_in
        side[v["gpu"]] = side.get(v["gpu"], 0) + v["bytes"]
    split = not set(gpu_in) & set(gpu_out)
    bound_s = max(list(gpu_in.values()) + list(gpu_out.values())) / (link_gbps * 1e9)
    for name in names:
        per_iter = [max(v[name][i] for v in res.values()) for i in range(len(res[0][name]))]
        med = statistics.median(per_iter)
        summary[name] = {"median_s": round(med, 5), "GBps": round(nbytes / med / 1e9, 2),
                         "GBps_per_receiving_gpu": round(max(gpu_in.values()) / med / 1e9, 2),
                         "all_s": [round(x, 5) for x in per_iter]}
        if split:
            summary[name][f"efficiency_vs_{link_gbps:g}GBps"] = round(bound_s / med, 3)
    s = {k: v["median_s"] for k, v in summary.items()}
    summary["ratios"] = {
        "m2n_vs_raw (raw/m2n, goal >= 0.95)": round(s["raw"] / s["m2n"], 3),
        "m2n_vs_per_param (per_param/m2n, goal >= 1.5)": round(s["per_param"] / s["m2n"], 3),
        "nccl_vs_raw (raw/nccl)": round(s["raw"] / s["nccl"], 3),
        "cast_overlap (m2n_cast / max(pack_only, raw), goal <= 1.1)":
            round(s["m2n_cast"] / max(s["pack_only"], s["raw"]), 3),
    }
    summary["bytes_received_by_workers"] = nbytes
    summary["gpus"] = {"trainers": sorted(gpu_out), "workers": sorted(gpu_in),
                       "names": sorted({v.get("gpu_name", "?") for v in res.values()}),
                       "bytes_in_per_gpu": gpu_in, "bytes_out_per_gpu": gpu_out,
                       "split": split, "lower_bound_s": round(bound_s, 6)}
    if "trace" in res[0]:
        summary["trace"] = {r: v["trace"] for r, v in res.items()}
    summary["grouping"] = res[0].get("grouping")
    summary["bit_exact"] = all(not v.get("bad_m2n") and not v.get("bad_nccl")
                               and not v.get("bad_broadcast") for r, v in res.items()
                               if r >= trainer_ranks)
    if "broadcast" in summary:
        summary["ratios"]["broadcast_vs_m2n (broadcast/m2n)"] = round(
            s.get("broadcast", 0) / s["m2n"], 3)
    for key in ("broadcast_error",):
        errs = {r: v[key] for r, v in res.items() if key in v}
        if errs:
            summary[key] = errs
    sweep = {}
    for n in names:
        if n.startswith("sweep_"):
            sweep[n] = {**res[0][f"{n}_config"], "median_s": summary.pop(n)["median_s"]}
    if sweep:
        summary["sweep_m2n"] = sweep
    errs = {n: v for n, v in res[0].items() if n.startswith("sweep_") and n.endswith("_error")}
    if errs:
        summary["sweep_errors"] = errs
    summary["m2n_teardown_finished"] = all(v.get("m2n_teardown_finished", True)
                                           for v in res.values())
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=256 << 20)
    ap.add_argument("--max-inflight", type=int, default=3)
    ap.add_argument("--max-cta", type=int, default=None,
                    help="M2N max_cta of the raw, per_param and m2n figures (default: M2N's)")
    ap.add_argument("--trainers", type=int, default=2, help="trainer ranks (mesh 1 x T)")
    ap.add_argument("--workers", type=int, default=2, help="worker ranks (mesh 1 x N)")
    ap.add_argument("--link-gbps", type=float, default=NVLINK_GBPS,
                    help="per-GPU bandwidth for the efficiency figure (multi-GPU only)")
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--diagnose", action="store_true",
                    help="also time raw-call variants, the m2n transport with blocking-sync "
                         "events and with one bucket, and trace one pipeline round")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="trace one m2n and one nccl round; write timeline_*.png there")
    ap.add_argument("--broadcast", action="store_true",
                    help="also time the packed-broadcast baseline (vLLM-style)")
    ap.add_argument("--sweep", action="store_true",
                    help="m2n over bucket_bytes x max_inflight x max_cta (1 iteration each)")
    ap.add_argument("--sweep-bucket-mb", default="16,64,256",
                    help="bucket sizes of the sweep (MiB, comma-separated)")
    ap.add_argument("--sweep-inflight", default="1,3", help="max_inflight values of the sweep")
    ap.add_argument("--sweep-cta", default="none",
                    help="max_cta values of the sweep ('none' = M2N's default)")
    ap.add_argument("--out", default=None, help="append the JSON summary to this file")
    args = ap.parse_args()
    case = {"model": args.model, "iters": args.iters, "bucket_bytes": args.bucket_bytes,
            "max_inflight": args.max_inflight, "max_cta": args.max_cta, "diagnose": args.diagnose,
            "timeline": bool(args.timeline), "broadcast": args.broadcast,
            "sweep": [[int(bb) << 20, int(mi), None if cta == "none" else int(cta)]
                      for bb in args.sweep_bucket_mb.split(",")
                      for mi in args.sweep_inflight.split(",")
                      for cta in args.sweep_cta.split(",")] if args.sweep else []}
    t0 = time.time()
    run = _world.run_world("gpu_sync_bench:bench_rank", case, trainer_ranks=args.trainers,
                           world_size=args.trainers + args.workers, timeout=args.timeout)
    summary = {"case": case, "topology": f"{args.trainers}+{args.workers}",
               "wall_s": round(time.time() - t0, 1), "exitcodes": run["exitcodes"],
               **summarize(run, args.trainers, args.link_gbps)}
    if args.timeline and "errors" not in summary:
        os.makedirs(args.timeline, exist_ok=True)
        for label in ("m2n", "nccl"):
            lanes = {f"rank {r}": v[f"timeline_{label}"] for r, v in
                     sorted(run["results"].items()) if f"timeline_{label}" in v}
            if lanes:
                path = os.path.join(args.timeline, f"timeline_{label}.png")
                write_timeline_png(path, lanes)
                summary[f"timeline_{label}"] = {"png": path, "lanes": lanes}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary) + "\n")
    return 0 if "errors" not in summary else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
