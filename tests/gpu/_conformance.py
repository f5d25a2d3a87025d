"""The ``Transport`` conformance checks (``tests/dataplanes/conformance.py``) as a GPU
scenario: every rank opens each lane of ``case["transports"]`` on the real runtime over the
world's store and runs ``case["check"]`` on it (``test_gpu_conformance.py``)."""

from __future__ import annotations

import importlib
from typing import Any

from m2n_async.testing._gpu import RankCtx, close_transport, open_transport

# The suite lives beside the fake runtime's tests; this package is ``gpu`` under pytest (the
# tests directory on sys.path) and ``tests.gpu`` where the repository root is.
_TESTS = (__package__ or "").rpartition(".")[0]
conformance: Any = importlib.import_module(
    f"{_TESTS}.dataplanes.conformance" if _TESTS else "dataplanes.conformance")


async def run(ctx: RankCtx) -> dict[str, Any]:
    case = ctx.case
    check = conformance.CHECKS[case["check"]]
    out: dict[str, Any] = {}
    for lane in case["transports"]:
        plan = conformance.plan_for(case["layout"])
        t = await open_transport(ctx, lane, plan, bucket_bytes=conformance.BUCKET_BYTES,
                                 max_inflight=conformance.MAX_INFLIGHT,
                                 tag=f"conformance-{case['check']}-{lane}")
        try:
            await ctx.barrier(f"conformance-{case['check']}-{lane}")
            await check(ctx.rank, t)
        finally:
            out[lane] = await close_transport(t)
    return out
