"""The ``Transport`` conformance checks (``tests/dataplanes/conformance.py``) as a GPU
scenario: every rank runs each check of ``case["checks"]`` in turn, opening each lane of
``case["transports"]`` on the real runtime over the world's store for it
(``test_gpu_conformance.py``). Returns ``{check: {lane: close info}}``, or ``{check:
{"error", "traceback", "lane"}}`` for a check that raised on this rank: the later checks
still run, so one world reports every check of its layout."""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from m2n_async.testing._gpu import RankCtx, close_transport, open_transport

# The suite lives beside the fake runtime's tests; this package is ``gpu`` under pytest (the
# tests directory on sys.path) and ``tests.gpu`` where the repository root is.
_TESTS = (__package__ or "").rpartition(".")[0]
conformance: Any = importlib.import_module(
    f"{_TESTS}.dataplanes.conformance" if _TESTS else "dataplanes.conformance")


async def _one(ctx: RankCtx, name: str, lane: str) -> dict[str, Any]:
    plan = conformance.plan_for(ctx.case["layout"])
    tag = f"conformance-{name}-{lane}"  # each check's own communicator and barrier
    t = await open_transport(ctx, lane, plan, bucket_bytes=conformance.BUCKET_BYTES,
                             max_inflight=conformance.MAX_INFLIGHT, tag=tag)
    try:
        await ctx.barrier(tag)
        await conformance.CHECKS[name](ctx.rank, t)
    finally:
        closed = await close_transport(t)
    return closed


async def run(ctx: RankCtx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ctx.case["checks"]:
        out[name] = {}
        for lane in ctx.case["transports"]:
            try:
                out[name][lane] = await _one(ctx, name, lane)
            except Exception as exc:  # recorded per check: the next check still runs
                out[name] = {"error": f"{type(exc).__name__}: {exc}", "lane": lane,
                             "traceback": traceback.format_exc()[-3000:]}
                break
    return out
