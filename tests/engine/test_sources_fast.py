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

from m2n_async._engine import _sources
from m2n_async._engine._sources import (
    _INLINE_PARAMS,
    Recheck,
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


def _nested(t: torch.Tensor) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # torch.nested says it is a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([t.reshape(-1), t.reshape(-1)])


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
    # a nested tensor: a torch guard reading its strides would abort the process
    "nested": lambda d, n: d.__setitem__(n, _nested(d[n])),
    "missing": lambda d, n: d.__delitem__(n),
}


@pytest.fixture(params=["guards", "no guards"])
def guards(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each test twice: with torch's ``TensorGuards`` re-checking the chunks that passed, and
    as on a torch without them (the fast pass every round)."""
    if request.param == "no guards":
        monkeypatch.setattr(_sources, "_tensor_guards", lambda: None)
        return False
    return True


@pytest.mark.parametrize("fault", sorted(_FAULTS))
@pytest.mark.parametrize("where", [0, _INLINE_PARAMS + 2, _INLINE_PARAMS + 3, N - 2, N - 1])
def test_a_change_after_a_good_round_is_refused(fault: str, where: int, guards: bool) -> None:
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


def _counting_fast_pass(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many chunks run the fast pass (``laid_out``) from now on, as a one-item list."""
    calls = [0]
    real = _sources.laid_out

    def counted(*args: object) -> bool:
        calls[0] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_sources, "laid_out", counted)
    return calls


def test_chunks_that_passed_are_rechecked_without_the_fast_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a round that passed, each chunk is re-checked by one C call: no chunk runs the
    fast pass again while nothing changed; a changed shard sends only its own chunk through
    it (and on to the error naming it)."""
    calls = _counting_fast_pass(monkeypatch)
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    chunks = len(eng.expect.chunks(eng.names, 0, N))
    assert calls[0] == chunks == 3
    for _ in range(2):
        eng.round(shards)
    assert calls[0] == chunks  # torch's TensorGuards served both rounds
    # new tensors of the same kind (a dict rebuilt each round, to_local() views) pass too
    eng.round({k: v.clone() for k, v in shards.items()})
    assert calls[0] == chunks
    shards["p3"] = torch.zeros(5)
    with pytest.raises(PlanError, match="'p3'"):
        eng.round(shards)
    assert calls[0] == chunks + 1


def test_an_accepted_change_passes_and_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the guard refuses but the contract accepts (another accepted dtype, a tensor now
    requiring grad) passes the fast pass, and the next round re-checks the new kind."""
    calls = _counting_fast_pass(monkeypatch)
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    shards["half"] = shards["half"].float()  # an fp32 master for the bf16 wire
    shards["p0"] = shards["p0"].clone().requires_grad_()
    assert eng.round(shards)._checked
    after = calls[0]
    assert eng.round(shards)._checked
    assert calls[0] == after


def test_two_kinds_of_source_alternating_are_both_rechecked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rounds alternating with fp32-master rounds (two kinds of the same shards): once
    each passed, both are re-checked without the fast pass; a third kind displaces the
    older guard."""
    calls = _counting_fast_pass(monkeypatch)
    eng = _Engine()
    wire = source_shards(eng.plan, 0)
    masters = dict(wire, half=wire["half"].float())  # the last chunk's kind changes
    eng.round(wire)
    eng.round(masters)
    settled = calls[0]
    for _ in range(3):
        eng.round(wire)
        eng.round(masters)
    assert calls[0] == settled
    third = dict(wire, half=wire["half"].double())  # float64 masters: another accepted kind
    eng.round(third)
    assert calls[0] == settled + 1
    eng.round(masters)  # the newer of the two older kinds is still kept
    assert calls[0] == settled + 1
    eng.round(wire)  # the oldest was displaced
    assert calls[0] == settled + 2


def test_recheck_is_stricter_than_the_contract() -> None:
    """``Recheck.passes`` only for tensors like those recorded: the type, dtype, device, sizes,
    strides and requires_grad each count, and so does their number."""
    base = (torch.zeros(4), torch.zeros(2, 3))
    rc = Recheck()
    assert not rc.passes("k", base)  # nothing recorded
    rc.passed("k", base)
    assert rc.passes("k", base)
    assert rc.passes("k", (torch.ones(4), torch.ones(2, 3)))  # other tensors, the same kind
    others = {
        "dtype": (torch.zeros(4, dtype=torch.float64), base[1]),
        "sizes": (torch.zeros(5), base[1]),
        "strides": (base[0], torch.zeros(3, 2).t()),
        "device": (torch.zeros(4, device="meta"), base[1]),
        "requires_grad": (torch.zeros(4, requires_grad=True), base[1]),
        "type": (torch.nn.Parameter(torch.zeros(4)), base[1]),
        "fewer": base[:1],
        "more": (*base, base[0]),
    }
    for what, ts in others.items():
        assert not rc.passes("k", ts), what
    assert not rc.passes("other key", base)


def test_recheck_keeps_no_tensor_alive() -> None:
    """A guard records metadata only: shards dropped by the caller are freed."""
    import gc
    import weakref

    t = torch.zeros(4)
    ref = weakref.ref(t)
    rc = Recheck()
    rc.passed("k", (t,))
    del t
    gc.collect()
    assert ref() is None


def test_a_chunk_with_a_tensor_twice_is_left_to_the_fast_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensor under two names (tied weights): a torch guard refuses any repeated
    argument, so that chunk gets no guard and runs the fast pass each round, without a new
    guard built every round; the other chunks keep theirs."""
    made = [0]
    real = _sources._tensor_guards()
    assert real is not None

    def counting(*args: object, **kw: object) -> object:
        made[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(_sources, "_tensor_guards", lambda: counting)
    calls = _counting_fast_pass(monkeypatch)
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    shards["p1"] = shards["p0"]  # both (4,) float32: tied
    for _ in range(4):
        assert eng.round(shards)._checked
    assert made[0] == 3  # one guard tried per chunk, once
    assert calls[0] == 3 + 3  # the first round's three chunks, then the tied chunk alone


def _counting_nested_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors' ``is_nested`` the re-check reads (its screen before a guard)."""
    reads = [0]

    def counted(t: torch.Tensor) -> bool:
        reads[0] += 1
        return bool(t.is_nested)

    monkeypatch.setattr(_sources, "_IS_NESTED", counted)
    return reads


def test_every_recheck_screens_for_nested_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-check reads every tensor's ``is_nested`` before its guard, every round, the
    very objects it was recorded with included (``swap_tensors`` makes one nested in place)."""
    reads = _counting_nested_reads(monkeypatch)
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)  # the fast pass records the guards
    assert reads[0] == 0
    eng.round(shards)
    assert reads[0] == N
    eng.round({k: v.clone() for k, v in shards.items()})
    assert reads[0] == 2 * N


def test_a_source_swapped_for_a_nested_tensor_is_refused_by_name(guards: bool) -> None:
    """``torch.utils.swap_tensors`` turns the very object a guard was recorded with into a
    nested tensor: it is screened and refused by name, not given to a guard that would abort
    the process."""
    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    eng.round(shards)
    for name in (eng.names[0], eng.names[_INLINE_PARAMS + 3], eng.names[N - 2]):
        t = shards[name]
        torch.utils.swap_tensors(t, _nested(torch.zeros(4)))
        assert shards[name] is t and t.is_nested
        with pytest.raises(PlanError, match=f"{name!r}.*nested"):
            eng.round(shards)
        shards[name] = torch.zeros(4)


def test_sources_stay_swappable() -> None:
    """The checks keep no reference to a source, not even a weak one: ``swap_tensors``
    refuses a tensor that has one, and ``Module.to`` swaps parameters under
    ``set_swap_module_params_on_conversion(True)`` (and for wrapper subclasses)."""
    import weakref

    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    eng.round(shards)
    assert all(weakref.getweakrefcount(t) == 0 for t in shards.values())
    module = torch.nn.Module()
    module.p = torch.nn.Parameter(shards[eng.names[0]].clone())
    params = dict(shards)
    params[eng.names[0]] = module.p
    eng.round(params)
    eng.round(params)
    old = torch.__future__.get_swap_module_params_on_conversion()
    try:
        torch.__future__.set_swap_module_params_on_conversion(True)
        module.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert module.p.dtype is torch.float64


def test_a_nested_tensor_under_an_old_objects_name_is_refused(guards: bool) -> None:
    """Identity is by object: a nested tensor put where a recorded tensor was (that tensor
    then dead, its address free for reuse) is screened and refused by name, not given to a
    guard that would abort the process."""
    import gc

    eng = _Engine()
    shards = source_shards(eng.plan, 0)
    eng.round(shards)
    eng.round(shards)
    for name in (eng.names[0], eng.names[_INLINE_PARAMS + 3], eng.names[N - 2]):
        del shards[name]
        gc.collect()
        shards[name] = _nested(torch.zeros(4))
        with pytest.raises(PlanError, match=repr(name)):
            eng.round(shards)
        shards[name] = torch.zeros(4)
