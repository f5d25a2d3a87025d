"""The worker's target checks: every round, each target written in place is still what the
plan says (dtype, local shape, contiguous, on the device) before a byte lands in it.

Theory of operation (DESIGN §6). Targets are checked against the plan at connect, but a
caller may give a target new storage between rounds (``target.data = ...``, ``Module.to``):
the lanes read the addresses every round and write there. New storage of another dtype,
shape or layout would take the wire bytes as they are — a tensor of garbage committed as a
valid version, or a receive posted into a smaller buffer (Gloo aborts the process). So each
bucket's in-place targets are checked when the pipeline reaches the bucket, before it is
staged (so that the work overlaps the transfer of the bucket before), and a target that
fails makes this rank's part of the round fail with the ``PlanError`` that names the
parameter: every rank then raises the round's ``TransferError`` with that text.

The per-round cost, as for the trainer's sources (``_sources``): the targets are fixed
objects (the engine's ``SinkMap``), so the tables of each bucket — the target tensors, their
expected dtypes and shapes — are built once, at connect; a round reads each tensor's dtype,
shape, device and contiguity with C-level ``map`` calls over chunks of ``_INLINE_PARAMS``,
with a checkpoint between chunks; a chunk that passed is re-checked next round by one C call
(``_sources.Recheck``). A chunk that fails the fast pass goes through
``validate_local_buffer``, which explains.

Where the pass runs: ``receive`` runs it over every bucket (``precheck``) before it waits for
the round to start, while the trainers check their sources and publish the start, so that
the pass is off the round's path. When the round starts within ``FRESH_S`` of that pass, a
bucket that passed is only looked at for targets given new storage since (their addresses,
read anyway by the lanes: new storage is what could take a write past its end), and checked
whole if one was; a later start (a worker that waited for the next step of training) checks
each bucket whole again before staging it. The addresses read in the round go to the lane
with the bucket (``CheckedTargets``, ``Transport.use_checked_targets``): it compares them with
those it built its copies for instead of reading every target's address a second time. A
bucket that failed is checked again in the round, where it fails the round as above:
nothing fails before the round, which the trainers would otherwise wait out. A target
changed by another thread or task while ``receive`` runs is a race with the round whichever
pass runs: change targets between rounds.

Targets must not share memory (connect's ``_check_disjoint``). New storage may: when an
address ``precheck`` read has moved, it runs that check again over the targets as they are,
and a round fails with its ``PlanError`` naming both parameters (``_check_overlap``).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

import anyio.lowlevel

from m2n_async._data._transport import CheckedTargets, SinkMap
from m2n_async._engine._sources import (
    _DTYPE,
    _INLINE_PARAMS,
    _IS_NESTED,
    Recheck,
    device_predicates,
    laid_out,
)
from m2n_async._proto.errors import PlanError
from m2n_async._proto.plan import TransferPlan, validate_local_buffer

if TYPE_CHECKING:
    from m2n_async._proto.plan import Bucket

__all__ = ["FRESH_S", "TargetCheck", "check_targets", "target_expectations"]

#: How long after ``precheck`` a round may start and still use its verdicts (module doc): a
#: worker called as a round begins (vLLM's update RPC, a receive loop that keeps up) is well
#: inside it; one that waited for a training step checks in the round.
FRESH_S = 0.25


def target_expectations(plan: TransferPlan, rank: int) -> list[tuple[Any, Any] | None]:
    """Per param, the wire dtype (a ``torch.dtype``) and the local shape (a ``torch.Size``) of
    this rank's target; None where ``rank`` is not in the parameter's destination mesh
    (``validate_local_buffer`` names it). Once per geometry, not per parameter: 10^5 experts
    share a handful, and each entry costs a few microseconds (as ``_source_expectations``)."""
    import torch

    per_geo: dict[int, tuple[Any, Any] | None] = {}
    out: list[tuple[Any, Any] | None] = []
    for p, gid in zip(plan.params, plan._geo_index(), strict=True):
        if gid not in per_geo:
            dst = p.dst
            per_geo[gid] = ((getattr(torch, p.spec.dtype),
                             torch.Size(dst.local_shape(p.spec.shape, rank)))
                            if dst.mesh.contains(rank) else None)
        out.append(per_geo[gid])
    return out


def _fits(ts: tuple[Any, ...], dtypes: Sequence[Any], shapes: Sequence[Any],
          on_device: Callable[[tuple[Any, ...]], bool]) -> bool:
    """The fast pass over tensors ``ts``: none nested (first: a nested tensor's shape
    raises; ``swap_tensors`` can make a target nested after connect), each of its planned
    dtype and shape, on the device and contiguous."""
    return (not any(map(_IS_NESTED, ts))
            and all(map(operator.is_, map(_DTYPE, ts), dtypes))
            and laid_out(ts, shapes, on_device))


def check_targets(plan: TransferPlan, declared: Sequence[Any], rank: int, device: str,
                  expect: Sequence[tuple[Any, Any] | None] | None = None) -> None:
    """Raise the ``PlanError`` of ``validate_local_buffer`` for the first of ``declared`` (per
    param, in plan order: the target tensor, or what a load callback declared) that does not
    fit its parameter's destination shard on ``rank`` and ``device``. Connect's check: plain
    tensors go through the round's fast pass, a chunk of ``_INLINE_PARAMS`` at a time with
    C-level ``map`` calls (10^5 targets on the CPU dev box: 0.06 s, against 0.3 s for one
    ``validate_local_buffer`` each); a chunk holding anything else (a declaration, a nested
    tensor, a target that does not fit) goes through ``validate_local_buffer`` per target,
    which explains."""
    import torch

    if expect is None:
        expect = target_expectations(plan, rank)
    on_device = device_predicates(device)[1]
    tensor = torch.Tensor
    params = plan.params
    for a in range(0, len(params), _INLINE_PARAMS):
        ts = tuple(declared[a:a + _INLINE_PARAMS])
        ex = [e for e in expect[a:a + _INLINE_PARAMS] if e is not None]
        if (len(ex) == len(ts) and all(map(isinstance, ts, repeat(tensor)))
                and _fits(ts, [e[0] for e in ex], [e[1] for e in ex], on_device)):
            continue
        for p, t in zip(params[a:a + _INLINE_PARAMS], ts, strict=True):
            validate_local_buffer(p, t, rank, "destination", device=device)
    _check_disjoint(plan, declared)


_NBYTES = operator.attrgetter("nbytes")


def _check_disjoint(plan: TransferPlan, declared: Sequence[Any]) -> None:
    """``PlanError`` naming two parameters whose in-place targets share memory (one tensor
    given twice, or overlapping views): a round would write both parameters' bytes there,
    the later one winning, and commit. Each target is contiguous (checked before), so its
    bytes are one range; sorted by start, a range that begins before the previous one ends
    overlaps it. One sort at connect (10^5 targets: ~0.05 s on the CPU dev box)."""
    import torch

    idx = [i for i, t in enumerate(declared) if isinstance(t, torch.Tensor)]
    ts = [declared[i] for i in idx]
    starts = list(map(torch.Tensor.data_ptr, ts))
    ends = list(map(operator.add, starts, map(_NBYTES, ts)))
    # no bytes, no memory to share: an empty shard, a meta tensor (address 0)
    order = sorted((k for k in range(len(ts)) if starts[k] and ends[k] > starts[k]),
                   key=starts.__getitem__)
    if len(order) < 2:
        return
    prev = order[0]
    for k in order[1:]:
        if starts[k] < ends[prev]:
            a, b = sorted((idx[prev], idx[k]))
            same = starts[k] == starts[prev] and ends[k] == ends[prev]
            raise PlanError(
                f"the targets of parameters {plan.params[a].spec.name!r} and "
                f"{plan.params[b].spec.name!r} share memory "
                f"({'the same bytes' if same else 'overlapping bytes'}): a round "
                f"would write both parameters' bytes there and commit whichever landed last. "
                f"Give each parameter a target of its own; a tied weight is one parameter "
                f"(named_parameters() yields it once): leave its second name out of the plan")
        if ends[k] > ends[prev]:
            prev = k


#: One chunk: the plan indices of its in-place targets, the tensors, their wire dtypes and
#: local shapes.
_Chunk = tuple[list[int], tuple[Any, ...], list[Any], list[Any]]


class TargetCheck:
    """The in-place targets of each bucket, checked every round (module docstring)."""

    def __init__(self, plan: TransferPlan, sinks: SinkMap, rank: int, device: str,
                 hand: Callable[[int, CheckedTargets], None] | None = None,
                 expect: Sequence[tuple[Any, Any] | None] | None = None) -> None:
        """``hand(bucket, checked)``: where a bucket's targets go once checked in the round
        with their addresses read (the transport's ``use_checked_targets``). ``expect``:
        ``target_expectations(plan, rank)`` when the caller has it (connect's check)."""
        import torch

        self._plan = plan
        self._expect = target_expectations(plan, rank) if expect is None else expect
        self._rank = rank
        self._device = device
        self._all_on_device = device_predicates(device)[1]
        self._chunks: dict[tuple[int, int], list[_Chunk]] = {}  # per bucket, on first use
        self._sinks = sinks
        self._torch = torch
        #: bucket -> its targets' addresses, for the buckets that passed ``precheck``
        self._passed: dict[int, list[int]] = {}
        #: bucket (start, stop) -> its in-place targets' plan indices and the tensors, flat
        self._flat: dict[tuple[int, int], tuple[tuple[int, ...], tuple[Any, ...]]] = {}
        self._hand = hand
        self._prechecked_at: float | None = None
        #: the chunks that passed, re-checked next round by one C call (``_sources.Recheck``)
        self._recheck = Recheck()
        #: ``_passed`` when the targets were last found not to share memory (connect checked
        #: the first storage; ``precheck`` checks again when an address moved), and what the
        #: check found then: a round fails with it (``__call__``)
        self._disjoint_at: dict[int, list[int]] | None = None
        self._overlap: PlanError | None = None

    def _tables(self, start: int, stop: int, sinks: SinkMap) -> list[_Chunk]:
        got = self._chunks.get((start, stop))
        if got is None:
            got = self._chunks[start, stop] = []
            idx = [i for i in range(start, stop)
                   if (s := sinks.get(self._plan.params[i].spec.name)) is not None
                   and s.in_place]
            expect = self._expect
            for a in range(0, len(idx), _INLINE_PARAMS):
                part = idx[a:a + _INLINE_PARAMS]
                # None (this rank is not in the destination mesh: connect refuses that)
                # matches no dtype or shape, so the chunk goes to ``_explain``, which names it
                ex = [expect[i] or (None, None) for i in part]
                got.append((part,
                            tuple(sinks[self._plan.params[i].spec.name].tensor for i in part),
                            [e[0] for e in ex], [e[1] for e in ex]))
        return got

    async def precheck(self, buckets: Sequence[Bucket]) -> None:
        """The fast pass over every bucket, before the round (module doc): remembers which
        passed, and their targets' addresses, for the round's ``__call__``; raises nothing.
        Every ``receive`` call makes its own pass, however recent the last one: a target
        changed between two calls in a way that keeps its address (a dtype view, a shorter
        slice) is seen only by a pass, never by the address compare."""
        self._passed = {}
        self._prechecked_at = None
        data_ptr = self._torch.Tensor.data_ptr
        for bucket in buckets:
            if await self._fast(bucket):
                self._passed[bucket.index] = list(map(data_ptr, self._flat_of(bucket)[1]))
        if len(self._passed) == len(buckets) and self._passed != self._disjoint_at:
            self._check_overlap()
        self._prechecked_at = time.monotonic()

    def _check_overlap(self) -> None:
        """Targets given new storage since connect may share it (``b.data = a.data``, two
        parameters tied after connect): connect's check (``_check_disjoint``) again, over the
        targets as they are, when an address moved; its error fails the next round. Only
        then: a list compare a round otherwise (the addresses ``precheck`` read anyway)."""
        declared: list[Any] = [None] * len(self._plan.params)
        for flat in self._flat.values():
            for i, t in zip(*flat, strict=True):
                declared[i] = t
        try:
            _check_disjoint(self._plan, declared)
        except PlanError as exc:
            self._overlap = PlanError(f"{exc} (the targets changed after connect)")
        else:
            self._overlap = None
            self._disjoint_at = dict(self._passed)  # __call__ pops from _passed

    def _flat_of(self, bucket: Bucket) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """The bucket's in-place targets, flat: their plan indices and the tensors (built
        once per bucket, from its chunk tables)."""
        key = (bucket.start, bucket.stop)
        got = self._flat.get(key)
        if got is None:
            tables = self._tables(bucket.start, bucket.stop, self._sinks)
            got = self._flat[key] = (tuple(i for idx, _, _, _ in tables for i in idx),
                                     tuple(t for _, ts, _, _ in tables for t in ts))
        return got

    def started(self) -> None:
        """The round began: keep ``precheck``'s verdicts only if it ended within
        ``FRESH_S``."""
        at = self._prechecked_at
        if at is None or time.monotonic() - at > FRESH_S:
            self._passed = {}
        self._prechecked_at = None

    async def __call__(self, bucket: Bucket) -> None:
        """Raise ``PlanError`` naming the first of ``bucket``'s in-place targets that no
        longer has its planned dtype, local shape, contiguity or device. A bucket that passed
        ``precheck`` just before the round is only looked at for targets given new storage
        since (their addresses: a quarter of the pass's cost); one that did is checked."""
        if self._overlap is not None:
            raise self._overlap
        seen = self._passed.pop(bucket.index, None)  # a verdict serves one round
        if seen is not None:
            params, ts = self._flat_of(bucket)
            now = list(map(self._torch.Tensor.data_ptr, ts))
            if now == seen:
                if self._hand is not None:  # the lane need not read them again
                    self._hand(bucket.index, CheckedTargets(self._sinks, params, now))
                return
        await self._fast(bucket, explain=True)

    async def _fast(self, bucket: Bucket, *, explain: bool = False) -> bool:
        """Whether every in-place target of ``bucket`` passes the fast pass; with
        ``explain``, the first chunk that does not raises the ``PlanError`` naming it."""
        on_device = self._all_on_device
        recheck = self._recheck
        for a, (idx, ts, dtypes, shapes) in enumerate(
                self._tables(bucket.start, bucket.stop, self._sinks)):
            if a:
                await anyio.lowlevel.checkpoint()
            key = (bucket.start, bucket.stop, a)
            if recheck.passes(key, ts):
                continue
            if _fits(ts, dtypes, shapes, on_device):
                recheck.passed(key, ts)
                continue
            if not explain:
                return False
            self._explain(idx, ts)
        return True

    def _explain(self, idx: Sequence[int], ts: Sequence[Any]) -> None:
        for i, t in zip(idx, ts, strict=True):
            try:
                validate_local_buffer(self._plan.params[i], t, self._rank, "destination",
                                      device=self._device)
            except PlanError as exc:
                raise PlanError(f"{exc} (the target changed after connect: new storage "
                                f"must keep the planned dtype, shape, contiguity and "
                                f"device)") from None
