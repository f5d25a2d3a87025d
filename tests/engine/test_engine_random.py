"""Property: any small valid plan moves bit-exact through the engines on the Gloo plane."""

from __future__ import annotations

import anyio
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2n_async._proto.plan import TransferPlan
from m2n_async.testing import MemoryStore

from ._plans import R, make_plan, random_defs, source_shards
from .test_engine_local import CFG, _check, _close, _connect_all, _round

_PLACEMENTS = st.sampled_from([None, (R, 0), (R, 1), (R, 2), (0, R), (1, R)])
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool,
                           torch.int16, torch.float64, torch.uint8])


@st.composite
def _plans(draw: st.DrawFn) -> tuple[TransferPlan, int]:
    src_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1)]))
    dst_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3)]))
    defs = random_defs(draw, _DTYPES, _PLACEMENTS, params=(1, 3))
    return make_plan(defs, src_dims, dst_dims), draw(st.sampled_from([64, 1 << 20]))


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_random_plans_bit_exact_through_gloo(case: tuple[TransferPlan, int]) -> None:
    plan, bucket_bytes = case
    cfg = CFG.__class__(**{**CFG.__dict__, "bucket_bytes": bucket_bytes})

    async def main() -> None:
        trainers, workers = await _connect_all(MemoryStore(), plan, cfg)
        try:
            res = await _round(trainers, workers,
                               lambda e: e.sync_weights(source_shards(plan, e.rank, 1)))
            assert {r.version for r in res} == {1}
            _check(plan, workers, 1)
        finally:
            await _close(*trainers, *workers)

    anyio.run(main)
