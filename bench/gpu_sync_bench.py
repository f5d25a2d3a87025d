"""GPU sync benchmark: the engine's bucket pipeline vs per-parameter M2N vs raw M2N, side by side.

One spawned world (2 trainer + 2 worker ranks by default, several ranks per GPU allowed with
libnccl >= 2.30) runs, on the same communicator and the same tensors, in one process run:

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

    python bench/gpu_sync_bench.py --model moe --out bench-gpu.json
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
}


def _defs(model: str) -> list[tuple[str, tuple[int, ...], str, Any, Any]]:
    m = MODELS[model]
    r = _world.R
    return [(f"layers.{i}.w", tuple(m["shape"]), "bfloat16", (r, 0), (r, 1))
            for i in range(m["n"])]


async def bench_rank(ctx: _world.RankCtx) -> dict[str, Any]:
    import torch

    case = ctx.case
    plan = _world.make_plan(_defs(case["model"]), (1, 2), (1, 2))
    trainer = ctx.rank < ctx.trainer_ranks
    dev = ctx.device
    iters = case["iters"]
    sources = _world.source_shards(plan, ctx.rank, 0, dev) if trainer else None
    sources32 = ({k: v.float() for k, v in sources.items()} if sources is not None else None)
    targets = None if trainer else _world.zero_targets(plan, ctx.rank, dev)
    out: dict[str, Any] = {"bytes": plan.send_bytes(ctx.rank) if trainer
                           else plan.recv_bytes(ctx.rank)}

    async def timed(name: str, fn: Any) -> None:
        times = []
        for it in range(iters + 1):
            await ctx.barrier(f"{name}-{it}")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t0)
        out[name] = times[1:]

    t = await _world.open_transport(ctx, "m2n", plan, bucket_bytes=case["bucket_bytes"],
                                    max_inflight=case["max_inflight"], tag="bench-m2n")
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

    await timed("raw", raw)
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
    await timed("per_param", per_param)
    await timed("m2n", lambda: pipeline(t, sources))
    await timed("m2n_cast", lambda: pipeline(t, sources32))

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
    out.update({f"m2n_{k}": v for k, v in (await _world.close_transport(t)).items()})

    if case.get("diagnose"):
        for tag, env, bb, mi in (
                ("m2n_blocking_events", {"M2N_ASYNC_CUDA_EVENT": "blocking",
                                         "M2N_ASYNC_CUDA_COMPLETION": "watch"}, None, None),
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
    await _world.close_transport(tn)
    return out


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    res = run["results"]
    errors = {r: v["error"] for r, v in res.items() if "error" in v}
    if errors:
        return {"errors": errors, "tracebacks": {r: v.get("traceback") for r, v in res.items()
                                                 if "error" in v}}
    names = [n for n in ("raw", "raw_after_default_stream_event", "raw_transfer_stream",
                         "raw_build_descs", "per_param", "m2n", "m2n_blocking_events",
                         "m2n_one_bucket", "nccl", "m2n_cast", "pack_only") if n in res[0]]
    summary: dict[str, Any] = {}
    nbytes = sum(v["bytes"] for r, v in res.items() if r >= 2)
    for name in names:
        per_iter = [max(v[name][i] for v in res.values()) for i in range(len(res[0][name]))]
        med = statistics.median(per_iter)
        summary[name] = {"median_s": round(med, 5), "GBps": round(nbytes / med / 1e9, 2),
                         "all_s": [round(x, 5) for x in per_iter]}
    s = {k: v["median_s"] for k, v in summary.items()}
    summary["ratios"] = {
        "m2n_vs_raw (raw/m2n, goal >= 0.95)": round(s["raw"] / s["m2n"], 3),
        "m2n_vs_per_param (per_param/m2n, goal >= 1.5)": round(s["per_param"] / s["m2n"], 3),
        "nccl_vs_raw (raw/nccl)": round(s["raw"] / s["nccl"], 3),
        "cast_overlap (m2n_cast / max(pack_only, raw), goal <= 1.1)":
            round(s["m2n_cast"] / max(s["pack_only"], s["raw"]), 3),
    }
    summary["bytes_received_by_workers"] = nbytes
    if "trace" in res[0]:
        summary["trace"] = {r: v["trace"] for r, v in res.items()}
    summary["grouping"] = res[0].get("grouping")
    summary["bit_exact"] = all(not v.get("bad_m2n") and not v.get("bad_nccl")
                               for r, v in res.items() if r >= 2)
    summary["m2n_teardown_finished"] = all(v.get("m2n_teardown_finished", True)
                                           for v in res.values())
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-inflight", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--diagnose", action="store_true",
                    help="also time raw-call variants, the m2n transport with blocking-sync "
                         "events and with one bucket, and trace one pipeline round")
    ap.add_argument("--out", default=None, help="append the JSON summary to this file")
    args = ap.parse_args()
    case = {"model": args.model, "iters": args.iters, "bucket_bytes": args.bucket_bytes,
            "max_inflight": args.max_inflight, "diagnose": args.diagnose}
    t0 = time.time()
    run = _world.run_world("gpu_sync_bench:bench_rank", case, trainer_ranks=2, world_size=4,
                           timeout=args.timeout)
    summary = {"case": case, "wall_s": round(time.time() - t0, 1),
               "exitcodes": run["exitcodes"], **summarize(run)}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary) + "\n")
    return 0 if "errors" not in summary else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
