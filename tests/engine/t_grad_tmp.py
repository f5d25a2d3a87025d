import pytest, torch
from m2n_async.testing import MemoryStore
from .test_engine_local import CFG, DEFS, _connect_all, _round, _close, _check, _targets
from ._plans import make_plan, source_shards

@pytest.mark.asyncio
async def test_params_requiring_grad() -> None:
    plan = make_plan(DEFS, (2, 1), (1, 2))
    store = MemoryStore()
    targets = {r: {n: (torch.nn.Parameter(t), p) for n, (t, p) in _targets(plan, r).items()} for r in (2, 3)}
    trainers, workers = await _connect_all(store, plan, targets=targets)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, e.rank, 1), version=1))
        _check(plan, workers, 1)
    finally:
        await _close(*trainers, *workers)
