"""Where a GPU round's fixed host time goes: per-rank timestamps of the m2n pipeline's steps.

One spawned world (1 trainer + 1 worker by default; on a multi-GPU host they get separate GPUs,
``m2n_async/testing/_gpu.gpu_of``) runs ``--iters`` rounds of the ``m2n`` transport through the
engine's bucket pipeline (``run_pipeline``), after 5 warm-up rounds. Each rank records, in
microseconds from the start of the round, when each bucket's sources were resolved
(``bN.src``, trainer), entered and left ``stage`` and ``transfer`` (``transfer`` returns once
the bucket is submitted), when the native thread started the bucket's reshards
(``nN.native_begin``), when its completion signal fired and when the pipeline saw it
(``bN.signal_fired``, ``bN.wait_done``), the worker's unpack, and the end of the pipeline and of
the round (the trainer's ``torch.cuda.synchronize``). The medians over the rounds are printed as
JSON per rank, sorted by time.

Reading it (BENCHMARKS "Multi-GPU", the nvidia-h200-x2 run of 2026-11-29): the gap between
``b0.transfer_out`` and ``n0.native_begin`` is the native thread waiting for the GIL;
``t0`` → ``b0.transfer_out`` is the pipeline's own start-up; ``bN.signal_fired`` →
``bN.wait_done`` the loop's wake-up.

    python3 bench/gpu_round_marks.py --model dense
    python3 bench/gpu_round_marks.py --model dense --cast     # fp32 sources cast to bf16
    python3 bench/gpu_round_marks.py --model moe --trainers 2 --workers 2 --timers

``--timers`` adds, per round, the host time summed over each of the lane's steps inside stage,
transfer and unpack (``T.<step>``: the source pointer table, the Triton launch, the stream
events, ...); ``--profile`` prints a cProfile of every rank over the timed rounds (on Python
3.12 it sees every thread, and it inflates each C call, so read it for where, not how much).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any

from m2n_async._data._transport import sink_map
from m2n_async.testing import _gpu as _world

WARMUP = 5


def median_marks(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per mark, the median over the rounds that have it; sorted by time."""
    names = {k for r in rows for k in r}
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in names}
    return dict(sorted(med.items(), key=lambda kv: kv[1]))


def _time_steps(t: Any, marks: dict[str, float]) -> None:
    """``--timers``: the host time of the lane's steps inside stage / transfer / unpack,
    summed per round as ``T.<step>`` (microseconds; a sum, not a time stamp)."""
    import m2n_async._data.m2n as lane

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                key = f"T.{name}"
                marks[key] = marks.get(key, 0.0) + time.perf_counter() - t0
        return run

    for name in ("_pack", "_stacks", "_source_table", "_table", "sink_records",
                 "_scatter_lists", "_descriptors", "_bucket", "check_usable", "submit",
                 "completion_of"):
        setattr(t, name, timed(name, getattr(t, name)))
    for name in ("copy_many", "pointer_table"):
        setattr(lane, name, timed(name, getattr(lane, name)))
    streams = t.streams
    for name in ("wait", "record", "producer"):
        setattr(streams, name, timed(f"streams.{name}", getattr(streams, name)))


async def marks_rank(ctx: _world.RankCtx) -> dict[str, Any]:
    import torch
    from gpu_sync_bench import model_defs as _defs

    from m2n_async._engine._pipeline import run_pipeline

    case = ctx.case
    plan = _world.make_plan(_defs(case["model"]), (1, ctx.trainer_ranks),
                            (1, ctx.world_size - ctx.trainer_ranks))
    trainer = ctx.rank < ctx.trainer_ranks
    sources = _world.source_shards(plan, ctx.rank, 0, ctx.device) if trainer else None
    if sources is not None and case["cast"]:
        sources = {k: v.float() for k, v in sources.items()}
    targets = None if trainer else _world.zero_targets(plan, ctx.rank, ctx.device)
    # As the engine does at connect: the targets as Sink records once (a plain dict would
    # cost the lane a conversion per round on the worker's stage path).
    sinks = sink_map(targets) if targets is not None else None
    t = await _world.open_transport(ctx, "m2n", plan, bucket_bytes=case["bucket_bytes"],
                                    max_inflight=3, tag="marks")
    marks: dict[str, float] = {}
    native = [0]

    def mark(name: str) -> None:
        marks.setdefault(name, time.perf_counter())

    stage, transfer, unpack, begin = t.stage, t.transfer, t.unpack, t.begin_transfer

    async def traced_stage(bucket: Any, **kw: Any) -> Any:
        mark(f"b{bucket.index}.stage_in")
        st = await stage(bucket, **kw)
        mark(f"b{bucket.index}.stage_out")
        return st

    def traced_transfer(st: Any) -> Any:
        i = st.bucket.index
        mark(f"b{i}.transfer_in")
        completion = transfer(st)
        mark(f"b{i}.transfer_out")
        completion.signal.add_done_callback(lambda _s: mark(f"b{i}.signal_fired"))
        wait = completion.wait

        async def traced_wait() -> None:
            await wait()
            mark(f"b{i}.wait_done")

        completion.wait = traced_wait
        return completion

    async def traced_unpack(st: Any, sinks: Any) -> None:
        mark(f"b{st.bucket.index}.unpack_in")
        await unpack(st, sinks)
        mark(f"b{st.bucket.index}.unpack_out")

    def traced_begin(ready: Any, where: str) -> Any:  # on the native thread
        mark(f"n{native[0]}.native_begin")
        native[0] += 1
        return begin(ready, where)

    t.stage, t.transfer, t.unpack, t.begin_transfer = (traced_stage, traced_transfer,
                                                       traced_unpack, traced_begin)
    if case.get("timers"):
        _time_steps(t, marks)

    async def resolve(bucket: Any) -> Any:
        mark(f"b{bucket.index}.src")
        return sources

    rows: list[dict[str, float]] = []
    prof = cProfile.Profile() if case.get("profile") else None
    for it in range(case["iters"] + WARMUP):
        if prof is not None and it == WARMUP:
            prof.enable()
        await ctx.barrier(f"marks-{it}")
        torch.cuda.synchronize()
        marks.clear()
        native[0] = 0
        t.begin_round(it + 1, time.monotonic() + 60)
        t0 = time.perf_counter()
        await run_pipeline(t, t.ctx.buckets, max_inflight=3,
                           sources=resolve if trainer else None, sinks=sinks)
        mark("pipeline_end")
        if trainer:
            torch.cuda.synchronize()
        mark("end")
        t.end_round()
        rows.append({k: round((v if k.startswith("T.") else v - t0) * 1e6, 1)
                     for k, v in marks.items()})
    profile = None
    if prof is not None:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        profile = text.getvalue()
    await _world.close_transport(t)
    kept = rows[WARMUP:]
    ends = sorted(r["end"] for r in kept)
    return {"median_us": median_marks(kept),
            "end_us_p10_p50_p90": [ends[len(ends) // 10], ends[len(ends) // 2],
                                   ends[len(ends) * 9 // 10]],
            **({"profile": profile} if profile else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dense", choices=("dense", "large", "moe"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bucket-bytes", type=int, default=256 << 20)
    ap.add_argument("--cast", action="store_true", help="fp32 sources, cast to bf16 in stage")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile every rank over the timed rounds (top 25 by own time)")
    ap.add_argument("--timers", action="store_true",
                    help="sum the host time of the lane's steps per round (T.<step>, us)")
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    case = {"model": args.model, "iters": args.iters, "bucket_bytes": args.bucket_bytes,
            "cast": args.cast, "profile": args.profile,
            "timers": args.timers}
    run = _world.run_world("gpu_round_marks:marks_rank", case, trainer_ranks=args.trainers,
                           world_size=args.trainers + args.workers, timeout=300)
    ranks = {r: v for r, v in sorted(run["results"].items())}
    profiles = {r: v.pop("profile") for r, v in ranks.items() if "profile" in v}
    print(json.dumps({"case": case, "exitcodes": run["exitcodes"], "ranks": ranks}, indent=1))
    for r, text in profiles.items():
        print(f"--- rank {r} profile ---\n{text}")
    return 0 if all(code == 0 for code in run["exitcodes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
