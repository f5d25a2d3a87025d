"""The fast pass of the trainer's source checks for a plain dict (C-level maps over chunks,
tables kept across rounds): it accepts exactly what the per-parameter check accepts, every
round. A tensor replaced in the same dict, or changed in place (``.data`` reassigned, a
resize) after a round that passed, is still refused with the error naming it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import anyio
import pytest
import torch

from m2n_async._engine._sources import (
    _INLINE_PARAMS,
    _Expectations,
    _source_expectations,
    _Sources,
)
from m2n_async._proto.errors import PlanError
from m2n_async._proto.plan import Bucket, TransferPlan

from ._plans import make_plan, source_shards

N = 2 * _INLINE_PARAMS + 5
#: two buckets, the second starting mid-chunk
BUCKETS = (Bucket(0, 0, _INLINE_PARAMS + 3, 0), Bucket(1, _INLINE_PARAMS + 3, N, 0))


@functools.cache
def _plan() -> TransferPlan:
    defs = [(f"p{i}", (4,), torch.float32, None, None) for i in range(N - 2)]
    defs.append(("mat", (2, 6), torch.float32, None, None))
    defs.append(("half", (3,), torch.bfloat16, None, None))
    return make_plan(defs, (1, 1), (1, 1))


class _Engine:
    """What the engine keeps across rounds: the expectations (with their tables)."""

    def __init__(self) -> None:
        plan = _plan()
        self.plan = plan
        self.names = [p.spec.name for p in plan.params]
        self.expect = _source_expectations(plan, 0)

    def round(self, weights: object) -> _Sources:
        """One round's source resolution: ``precheck``, then every bucket."""
        src = _Sources(weights, self.plan, 0, "cpu", self.expect, self.names)

        async def main() -> None:
            await src.precheck()
            for b in BUCKETS:
                assert await src(b) is weights
        anyio.run(main)
        return src


def test_tables_kept_across_rounds() -> None:
    eng = _Engine()
    assert isinstance(eng.expect, _Expectations)
    shards = source_shards(eng.plan, 0)
    first = eng.round(shards)
    assert first._checked
    tables = dict(eng.expect._chunks)
    eng.round(shards)
    assert eng.expect._chunks.keys() == tables.keys()
    assert all(eng.expect._chunks[k] is v for k, v in tables.items())


def _replace(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1), t.reshape(-1)])


_FAULTS: dict[str, Callable[[dict[str, torch.Tensor], str], None]] = {
    # a new object in the same dict
    "replaced": lambda d, n: d.__setitem__(n, _replace(d[n])),
    # the same object, other metadata: .data reassigned (no version bump) or resized
    "data_shape": lambda d, n: setattr(d[n], "data", _replace(d[n].data)),
    "data_dtype": lambda d, n: setattr(d[n], "data", d[n].data.to(torch.int32)),
    "data_noncontiguous": lambda d, n: setattr(
        d[n], "data", torch.stack([d[n].data, d[n].data], dim=-1)[..., 0]),
    "resized": lambda d, n: d[n].resize_(1),
    "missing": lambda d, n: d.__delitem__(n),
}


@pytest.mark.parametrize("fault", sorted(_FAULTS))
@pytest.mark.parametrize("where", [0, _INLINE_PARAMS + 2, _INLINE_PARAMS + 3, N - 2, N - 1])
def test_a_change_after_a_good_round_is_refused(fault: str, where: int) -> None:
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)  # passes, tables built
    eng.round(shards)
    name = eng.names[where]
    _FAULTS[fault](shards, name)
    with pytest.raises(PlanError, match=repr(name)):
        eng.round(shards)


@pytest.mark.parametrize("fault", sorted(_FAULTS))
@pytest.mark.parametrize("where", [0, _INLINE_PARAMS + 3, N - 1])
def test_refused_before_any_bucket(fault: str, where: int) -> None:
    """Whatever is wrong with a shard of a plain dict (a missing name, another shape, dtype
    or layout) is refused by ``precheck``, before the round, not when its bucket is staged."""
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    name = eng.names[where]
    _FAULTS[fault](shards, name)
    src = _Sources(shards, eng.plan, 0, "cpu", eng.expect, eng.names)
    with pytest.raises(PlanError, match=f"{name!r}.*rank 0"):
        anyio.run(src.precheck)
    assert not src._checked


def test_a_mapping_proxy_is_checked_before_the_round() -> None:
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    del shards["mat"]
    src = _Sources(MappingProxyType(shards), eng.plan, 0, "cpu", eng.expect, eng.names)
    with pytest.raises(PlanError, match="no local shard for parameter 'mat' \\(rank 0\\)"):
        anyio.run(src.precheck)


def test_a_mapping_proxy_is_read_once_so_what_is_checked_is_what_is_sent() -> None:
    # A proxy forwards lookups to what it wraps, which may compute on each one: read once,
    # the buckets hand over the very tensors the check before the round saw.
    eng = _Engine()
    good = source_shards(eng.plan, 0)
    lookups: list[str] = []

    class Lazy(Mapping[str, torch.Tensor]):
        def __getitem__(self, k: str) -> torch.Tensor:
            lookups.append(k)
            # a second lookup of 'mat' computes a tensor of another shape
            return good[k].reshape(6, 2) if k == "mat" and lookups.count(k) > 1 else good[k]

        def __iter__(self) -> Iterator[str]:
            return iter(good)

        def __len__(self) -> int:
            return len(good)

    src = _Sources(MappingProxyType(Lazy()), eng.plan, 0, "cpu", eng.expect, eng.names)

    async def main() -> None:
        await src.precheck()
        for b in BUCKETS:
            m = await src(b)
            assert all(m[n].shape == good[n].shape for n in eng.names[b.start:b.stop])

    anyio.run(main)
    assert lookups.count("mat") == 1, lookups.count("mat")


def test_a_non_tensor_is_named() -> None:
    eng = _Engine()
    shards: dict[str, object] = dict(source_shards(eng.plan, 0))
    shards["p7"] = [1.0, 2.0, 3.0, 4.0]
    src = _Sources(shards, eng.plan, 0, "cpu", eng.expect, eng.names)
    with pytest.raises(PlanError, match="'p7' \\(rank 0\\) is a list, not a tensor"):
        anyio.run(src.precheck)


def test_buckets_read_nothing_after_precheck() -> None:
    """``precheck`` read every shard's dtype, shape, device and contiguity: a bucket reads
    none of them again (the per-round cost is one pass)."""
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    src = _Sources(shards, eng.plan, 0, "cpu", eng.expect, eng.names)

    async def main() -> None:
        await src.precheck()
        assert src._checked
        del shards["p3"]  # not looked up again: the caller keeps the dict as it was
        for b in BUCKETS:
            assert await src(b) is shards
    anyio.run(main)


def test_float_cast_sources_pass() -> None:
    """fp32 masters for a bf16 wire (and the reverse) are accepted by the fast pass too."""
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    shards["half"] = shards["half"].float()
    shards["p0"] = shards["p0"].to(torch.bfloat16)
    assert eng.round(shards)._checked


def test_device_checked_by_the_fast_pass() -> None:
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    shards["p3"] = shards["p3"].to("meta")
    with pytest.raises(PlanError, match="'p3'"):
        eng.round(shards)
