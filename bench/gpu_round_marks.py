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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from m2n_async.testing import _gpu as _world

WARMUP = 5


def median_marks(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per mark, the median over the rounds that have it; sorted by time."""
    names = {k for r in rows for k in r}
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in names}
    return dict(sorted(med.items(), key=lambda kv: kv[1]))


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

    async def resolve(bucket: Any) -> Any:
        mark(f"b{bucket.index}.src")
        return sources

    rows: list[dict[str, float]] = []
    for it in range(case["iters"] + WARMUP):
        await ctx.barrier(f"marks-{it}")
        torch.cuda.synchronize()
        marks.clear()
        native[0] = 0
        t.begin_round(it + 1, time.monotonic() + 60)
        t0 = time.perf_counter()
        await run_pipeline(t, t.ctx.buckets, max_inflight=3,
                           sources=resolve if trainer else None, sinks=targets)
        mark("pipeline_end")
        if trainer:
            torch.cuda.synchronize()
        mark("end")
        t.end_round()
        rows.append({k: round((v - t0) * 1e6, 1) for k, v in marks.items()})
    await _world.close_transport(t)
    return {"median_us": median_marks(rows[WARMUP:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dense", choices=("dense", "large", "moe"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bucket-bytes", type=int, default=256 << 20)
    ap.add_argument("--cast", action="store_true", help="fp32 sources, cast to bf16 in stage")
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    case = {"model": args.model, "iters": args.iters, "bucket_bytes": args.bucket_bytes,
            "cast": args.cast}
    run = _world.run_world("gpu_round_marks:marks_rank", case, trainer_ranks=args.trainers,
                           world_size=args.trainers + args.workers, timeout=300)
    print(json.dumps({"case": case, "exitcodes": run["exitcodes"],
                      "ranks": {r: v for r, v in sorted(run["results"].items())}}, indent=1))
    return 0 if all(code == 0 for code in run["exitcodes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
