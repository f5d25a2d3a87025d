"""The trainer's source resolution (``_Sources``): a plain dict is checked on the event loop
in chunks, every parameter still checked; other mappings, callables and iterators go off the
loop. Errors name the parameter."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import torch

from m2n_async._engine._engine import _INLINE_PARAMS, _source_expectations, _Sources
from m2n_async._proto.errors import PlanError
from m2n_async._proto.plan import Bucket, TransferPlan

from ._plans import make_plan, source_shards

N = 2 * _INLINE_PARAMS + 7  # three chunks, the last one partial


@functools.cache
def _plan() -> TransferPlan:
    defs = [(f"p{i}", (4,), torch.float32, None, None) for i in range(N - 1)]
    defs.append(("last", (2, 6), torch.bfloat16, (-1, 1), None))
    return make_plan(defs, (1, 2), (1, 1))


def _sources(plan: TransferPlan, weights: object, device: str = "cpu") -> _Sources:
    names = [p.spec.name for p in plan.params]
    return _Sources(weights, plan, 0, device, _source_expectations(plan, 0), names)


def _resolve(src: _Sources, bucket: Bucket) -> Mapping[str, torch.Tensor]:
    async def main() -> Mapping[str, torch.Tensor]:
        return await src(bucket)
    return anyio.run(main)


def test_plain_dict_checked_in_chunks_and_returned_as_is() -> None:
    plan = _plan()
    shards = source_shards(plan, 0)
    src = _sources(plan, shards)
    assert src.inline
    bucket = Bucket(0, 0, N, 0)
    assert _resolve(src, bucket) is shards
    # a second bucket starting mid-plan checks its own params against their own specs
    assert _resolve(src, Bucket(1, N - 3, N, 0)) is shards


@pytest.mark.parametrize("where", [0, _INLINE_PARAMS, N - 2, N - 1])
@pytest.mark.parametrize("fault", ["dtype", "shape", "noncontiguous", "missing"])
def test_every_param_is_checked(where: int, fault: str) -> None:
    plan = _plan()
    shards = source_shards(plan, 0)
    name = plan.params[where].spec.name
    t = shards[name]
    if fault == "dtype":
        shards[name] = t.to(torch.int32)  # a float cast is accepted; int <-> float is not
    elif fault == "shape":
        shards[name] = torch.cat([t.reshape(-1), t.reshape(-1)])
    elif fault == "noncontiguous":
        shards[name] = torch.stack([t, t], dim=-1)[..., 0]
        assert not shards[name].is_contiguous()
    else:
        del shards[name]
    with pytest.raises(PlanError, match=repr(name)):
        _resolve(_sources(plan, shards), Bucket(0, 0, N, 0))
    # the same through a callable (resolved on a thread)
    with pytest.raises(PlanError, match=repr(name)):
        _resolve(_sources(plan, lambda names: {n: shards[n] for n in names if n in shards}),
                 Bucket(0, 0, N, 0))


def test_device_mismatch_is_reported() -> None:
    plan = _plan()
    shards = source_shards(plan, 0)
    for device in ("cuda", "cuda:1", "meta"):
        with pytest.raises(PlanError, match="device"):
            _resolve(_sources(plan, shards, device), Bucket(0, 0, N, 0))


@pytest.mark.asyncio
async def test_a_module_with_tensors_the_plan_lacks_is_warned_once(
        caplog: pytest.LogCaptureFixture) -> None:
    # The module gained a tensor after connect (an adapter, say): the round moves the plan's
    # tensors, and the trainer is told once, by name, that the extra one is not sent.
    import logging

    from m2n_async import (
        EngineConfig,
        Layout,
        Mesh,
        ParamSpec,
        TrainerEngine,
        WorkerEngine,
    )
    from m2n_async.testing import MemoryStore

    class Net(torch.nn.Module):
        def __init__(self, extra: bool) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 4))
            if extra:
                self.lora = torch.nn.Parameter(torch.ones(2, 4))

    spec = ParamSpec("w", torch.float32, (4, 4), Layout(Mesh((1, 1)), None))
    cfg = EngineConfig(transport="gloo", phase_timeout=20, round_timeout=20, abort_grace=2,
                       host="127.0.0.1")
    store = MemoryStore()
    target = torch.zeros(4, 4)
    engines: dict[str, Any] = {}

    async def connect(side: str) -> None:
        if side == "t":
            engines[side] = await TrainerEngine.connect(
                store=store.session(), rank=0, trainer_ranks=1, world_size=2, params=[spec],
                config=cfg)
        else:
            engines[side] = await WorkerEngine.connect(
                store=store.session(), rank=1, trainer_ranks=1, world_size=2,
                targets={"w": (target, None)}, config=cfg)

    async with anyio.create_task_group() as tg:
        tg.start_soon(connect, "t")
        tg.start_soon(connect, "w")
    net = Net(extra=True)
    try:
        with caplog.at_level(logging.WARNING, logger="m2n_async"):
            for _ in range(2):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(engines["w"].receive)
                    await engines["t"].sync_weights(net)
        warned = [r.getMessage() for r in caplog.records if "not carry" in r.getMessage()]
        assert warned == ["sync_weights on rank 0: the module has 1 tensor(s) the plan does "
                          "not carry, not sent: 'lora' (the plan is what connect agreed; "
                          "connect again with specs_from_module of this module to carry "
                          "them)"], warned
        assert torch.equal(target, torch.ones(4, 4))
    finally:
        await engines["t"].close()
        await engines["w"].close()
