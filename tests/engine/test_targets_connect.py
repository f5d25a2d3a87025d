"""The worker's check of its targets at connect (``_targets.check_targets``): the round's fast
pass over chunks of plain tensors, ``validate_local_buffer`` only for a chunk that does not
pass. It must refuse exactly what the per-target check refuses, with the same words, and
read nothing per target when every target fits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from m2n_async import LoadTarget
from m2n_async._engine import _targets
from m2n_async._engine._sources import _INLINE_PARAMS
from m2n_async._engine._targets import TargetCheck, check_targets, target_expectations
from m2n_async._proto.errors import PlanError
from m2n_async._proto.layout import REPLICATE
from m2n_async._proto.plan import TransferPlan, validate_local_buffer

from ._plans import make_plan

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

R = (REPLICATE, 0)  # row-sharded along the TP axis
C = (REPLICATE, 1)  # column-sharded

#: Three geometries (row- and column-sharded on a 1 x 2 worker mesh, and replicated),
#: interleaved, across three chunks of the fast pass.
N = 2 * _INLINE_PARAMS + 7
DEFS = [(f"p{i}", (4, 6), "float32" if i % 3 != 2 else "bfloat16", None,
         (R if i % 3 == 0 else C if i % 3 == 1 else None)) for i in range(N)]
PLAN = make_plan(DEFS, (1, 1), (1, 2))
RANK = 2  # the second worker


def _targets_of(plan: TransferPlan, rank: int) -> list[Any]:
    return [torch.zeros(p.dst.local_shape(p.spec.shape, rank), dtype=getattr(torch, p.spec.dtype))
            for p in plan.params]


def _fault(t: torch.Tensor, how: str) -> Any:
    if how == "dtype":
        return t.to(torch.float64)
    if how == "shape":
        return torch.zeros(t.numel() + 1, dtype=t.dtype)
    if how == "strided":
        return torch.zeros((*t.shape, 2), dtype=t.dtype)[..., 0]
    if how == "device":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if how == "nested":
        return torch.nested.nested_tensor([torch.zeros(2, dtype=t.dtype)])
    if how == "declared-shape":  # a load callback's declaration of the wrong shape
        return LoadTarget((99,), t.dtype, None, lambda n, x: None)
    raise AssertionError(how)


def _per_target(plan: TransferPlan, declared: list[Any], rank: int) -> str | None:
    """What one ``validate_local_buffer`` per target, in plan order, raises (the reference)."""
    for p, t in zip(plan.params, declared, strict=True):
        try:
            validate_local_buffer(p, t, rank, "destination", device="cpu")
        except PlanError as exc:
            return str(exc)
    return None


def _fast(plan: TransferPlan, declared: list[Any], rank: int) -> str | None:
    try:
        check_targets(plan, declared, rank, "cpu")
    except PlanError as exc:
        return str(exc)
    return None


def test_targets_that_fit_pass() -> None:
    declared = _targets_of(PLAN, RANK)
    assert _per_target(PLAN, declared, RANK) is None
    assert _fast(PLAN, declared, RANK) is None


@pytest.mark.parametrize("how", ["dtype", "shape", "strided", "device", "nested",
                                 "declared-shape"])
@pytest.mark.parametrize("where", [0, _INLINE_PARAMS - 1, _INLINE_PARAMS + 5, N - 1])
def test_refuses_what_the_per_target_check_refuses_in_its_words(how: str, where: int) -> None:
    declared = _targets_of(PLAN, RANK)
    declared[where] = _fault(declared[where], how)
    want = _per_target(PLAN, declared, RANK)
    assert want is not None and f"'p{where}'" in want
    assert _fast(PLAN, declared, RANK) == want


def test_the_first_target_that_does_not_fit_is_named() -> None:
    declared = _targets_of(PLAN, RANK)
    for i in (N - 2, _INLINE_PARAMS + 1, 3):  # three chunks; plan order decides
        declared[i] = _fault(declared[i], "dtype")
    got = _fast(PLAN, declared, RANK)
    assert got == _per_target(PLAN, declared, RANK)
    assert got is not None and "'p3'" in got


def test_a_declaration_that_fits_passes() -> None:
    declared: list[Any] = _targets_of(PLAN, RANK)
    t = declared[4]
    declared[4] = LoadTarget(tuple(t.shape), t.dtype, None, lambda n, x: None)
    assert _per_target(PLAN, declared, RANK) is None
    assert _fast(PLAN, declared, RANK) is None


def test_targets_that_fit_read_no_per_target_check(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = _targets.validate_local_buffer

    def counting(p: Any, *args: Any, **kw: Any) -> None:
        calls.append(p.spec.name)
        real(p, *args, **kw)

    monkeypatch.setattr(_targets, "validate_local_buffer", counting)
    declared = _targets_of(PLAN, RANK)
    check_targets(PLAN, declared, RANK, "cpu")
    assert calls == []
    declared[_INLINE_PARAMS + 3] = _fault(declared[_INLINE_PARAMS + 3], "shape")
    with pytest.raises(PlanError, match=f"'p{_INLINE_PARAMS + 3}'"):
        check_targets(PLAN, declared, RANK, "cpu")
    # the first chunk passed whole; the second is explained up to the target that failed
    assert calls == [f"p{i}" for i in range(_INLINE_PARAMS, _INLINE_PARAMS + 4)]


def test_a_rank_outside_the_destination_mesh_is_named() -> None:
    # rank 1 is the first worker of a 1 + 1 plan; its targets asked of rank 0, a trainer
    plan = make_plan(DEFS[:3], (1, 1), (1, 1))
    declared = _targets_of(plan, 1)
    assert [e is None for e in target_expectations(plan, 0)] == [True] * 3
    want = _per_target(plan, declared, 0)
    assert want is not None and "rank is not in the destination mesh" in want
    assert _fast(plan, declared, 0) == want


def test_expectations_are_one_object_per_geometry() -> None:
    ex = target_expectations(PLAN, RANK)
    assert len(ex) == N
    assert len({id(e) for e in ex}) == 3
    for p, e in zip(PLAN.params, ex, strict=True):
        assert e == (getattr(torch, p.spec.dtype),
                     torch.Size(p.dst.local_shape(p.spec.shape, RANK)))


def test_the_round_check_takes_connects_expectations() -> None:
    from m2n_async._data._transport import Sink, SinkMap

    declared = _targets_of(PLAN, RANK)
    sinks = SinkMap({p.spec.name: Sink.of(t) for p, t in zip(PLAN.params, declared, strict=True)})
    ex = target_expectations(PLAN, RANK)
    check = TargetCheck(PLAN, sinks, RANK, "cpu", expect=ex)
    tables = check._tables(0, N, sinks)
    assert [d for _, _, ds, _ in tables for d in ds] == [e[0] for e in ex if e is not None]
    assert [s for _, _, _, ss in tables for s in ss] == [e[1] for e in ex if e is not None]
    # the same tables as a check that works them out itself
    own = TargetCheck(PLAN, sinks, RANK, "cpu")._tables(0, N, sinks)
    assert [(i, d, s) for i, _, d, s in own] == [(i, d, s) for i, _, d, s in tables]


def _kinds(t: torch.Tensor) -> list[tuple[str, Any]]:
    """Targets that fit, or not, in ways the fast pass reads differently from the per-target
    check (a subclass, autograd state, a view with flags, broadcast strides, a device)."""
    return [("same", t), ("requires-grad", t.clone().requires_grad_()),
            ("parameter", torch.nn.Parameter(t.clone())),
            ("neg-view", t._neg_view()),
            ("expanded", torch.zeros(1, *t.shape[1:], dtype=t.dtype).expand(*t.shape)),
            ("meta", torch.empty(t.shape, dtype=t.dtype, device="meta"))]


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cuda", "meta"])
def test_same_verdict_as_the_per_target_check_on_any_device(device: str) -> None:
    """Whatever the engine's device, a target of each kind gets the per-target check's
    verdict and words (the fast pass only ever accepts what that check accepts)."""
    base = _targets_of(PLAN, RANK)
    for i in (0, _INLINE_PARAMS + 1, N - 1):
        for how, t in _kinds(base[i]):
            declared = list(base)
            declared[i] = t
            want = None
            for p, d in zip(PLAN.params, declared, strict=True):
                try:
                    validate_local_buffer(p, d, RANK, "destination", device=device)
                except PlanError as exc:
                    want = str(exc)
                    break
            try:
                check_targets(PLAN, declared, RANK, device)
                got = None
            except PlanError as exc:
                got = str(exc)
            assert got == want, (device, i, how)


@pytest.mark.parametrize("how", ["same-tensor", "two-views-of-the-same-bytes",
                                 "overlapping-views"])
def test_targets_that_share_memory_are_refused_naming_both(how: str) -> None:
    # a round would write both parameters' bytes into the shared memory and commit
    declared = _targets_of(PLAN, RANK)
    a, b = 3, _INLINE_PARAMS + 1  # the same geometry, in two chunks
    shape, n = declared[a].shape, declared[a].numel()
    if how == "same-tensor":
        declared[b] = declared[a]
    else:
        buf = torch.zeros(2 * n, dtype=declared[a].dtype)
        shift = n // 2 if how == "overlapping-views" else 0
        declared[a] = buf[:n].view(shape)
        declared[b] = buf[shift:shift + n].view(shape)
    assert _per_target(PLAN, declared, RANK) is None  # each target fits on its own
    got = _fast(PLAN, declared, RANK)
    assert got is not None and f"'p{a}'" in got and f"'p{b}'" in got, got
    assert "share memory" in got
    assert ("the same bytes" in got) == (how != "overlapping-views"), got


def test_targets_back_to_back_in_one_buffer_pass() -> None:
    # views of one flat buffer that do not overlap (a flat parameter buffer) are fine
    declared = _targets_of(PLAN, RANK)
    total = sum(t.numel() * t.element_size() for t in declared)
    buf = torch.zeros(total, dtype=torch.uint8)
    off = 0
    for i, t in enumerate(declared):
        nb = t.numel() * t.element_size()
        declared[i] = buf[off:off + nb].view(t.dtype).view(t.shape)
        off += nb
    assert _fast(PLAN, declared, RANK) is None
