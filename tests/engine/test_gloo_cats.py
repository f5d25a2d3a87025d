"""The Gloo trainer's ``torch.cat`` packing of messages made of whole shards (``_Cats``,
cached per message and arena): right bytes over rounds with new tensor objects, the same
objects with ``.data`` reassigned, a source that is cast (falls back to the copying path and
counts the cast bytes), and a missing source (the error names it)."""

from __future__ import annotations

import pytest
import torch

from m2n_async._proto.errors import PlanError

from ._plans import expected_shards, make_plan, source_shards
from .test_gloo_staging import _wire, _World

DEFS = ([(f"v{i}", (5,), torch.float32, None, None) for i in range(20)]
        + [(f"m{i}", (3, 4), torch.float32, None, None) for i in range(6)]  # 2-D group
        + [(f"h{i}", (6,), torch.bfloat16, None, None) for i in range(7)]   # another dtype
        + [("x", (2, 2, 2), torch.float32, None, None)])
PLAN = make_plan(DEFS, (1, 1), (1, 1))


def _round(world: _World, sources: dict[str, torch.Tensor],
           targets: dict[str, torch.Tensor]) -> int:
    """One round through every bucket; returns the trainer's cast bytes."""
    cast = 0
    for b in world.buckets:
        send = world.tr[0]._pack(world.tr[0].packing(b), sources)
        recv = world.tr[1]._alloc_recv(world.tr[1].packing(b), targets)  # type: ignore[arg-type]
        _wire({0: send}, {1: recv})
        world.tr[1]._unpack(recv, targets)  # type: ignore[arg-type]
        cast += send.cast_bytes
        world.tr[0].release(send)
        world.tr[1].release(recv)
    return cast


def _check(targets: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, w in want.items():  # as bytes: random bit patterns include NaNs
        assert torch.equal(targets[name].reshape(-1).view(torch.uint8),
                           w.reshape(-1).view(torch.uint8)), name


def test_cat_path_rounds() -> None:
    world = _World(PLAN, 1 << 20, 2)
    try:
        targets = {k: torch.zeros_like(v) for k, v in expected_shards(PLAN, 1).items()}
        sources = source_shards(PLAN, 0, version=1)
        assert _round(world, sources, targets) == 0
        _check(targets, expected_shards(PLAN, 1, version=1))
        cats = [c for c in world.tr[0]._cat_cache.values() if c is not None]
        assert cats, "the whole-shard message was not packed with cat"
        # the same objects, new storage and bytes behind them (.data reassigned)
        for k, v in source_shards(PLAN, 0, version=2).items():
            sources[k].data = v
        assert _round(world, sources, targets) == 0
        _check(targets, expected_shards(PLAN, 1, version=2))
        # the same objects updated in place
        for k, v in source_shards(PLAN, 0, version=3).items():
            sources[k].copy_(v)
        _round(world, sources, targets)
        _check(targets, expected_shards(PLAN, 1, version=3))
        # one source now fp32 for a bf16 wire param: cast while packing, bytes counted
        sources["h2"] = sources["h2"].float()
        assert _round(world, sources, targets) == sources["h2"].numel() * 2
        _check(targets, {**expected_shards(PLAN, 1, version=3),
                         "h2": sources["h2"].to(torch.bfloat16)})
        # and back: cat again
        sources["h2"] = expected_shards(PLAN, 1, version=4)["h2"]
        assert _round(world, sources, targets) == 0
        assert torch.equal(targets["h2"].view(torch.uint8), sources["h2"].view(torch.uint8))
        del sources["v7"]
        with pytest.raises(PlanError, match="'v7'"):
            _round(world, sources, targets)
    finally:
        world.close()
