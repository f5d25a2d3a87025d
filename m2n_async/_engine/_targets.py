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
with a checkpoint between chunks. A chunk that fails the fast pass goes through
``validate_local_buffer``, which explains.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio.lowlevel

from m2n_async._data._transport import SinkMap
from m2n_async._engine._sources import _DTYPE, _INLINE_PARAMS, device_predicates, laid_out
from m2n_async._proto.errors import PlanError
from m2n_async._proto.plan import TransferPlan, validate_local_buffer

if TYPE_CHECKING:
    from m2n_async._proto.plan import Bucket

__all__ = ["TargetCheck"]

#: One chunk: the plan indices of its in-place targets, the tensors, their wire dtypes and
#: local shapes.
_Chunk = tuple[list[int], tuple[Any, ...], list[Any], list[Any]]


class TargetCheck:
    """The in-place targets of each bucket, checked every round (module docstring)."""

    def __init__(self, plan: TransferPlan, sinks: SinkMap, rank: int, device: str) -> None:
        import torch

        self._plan = plan
        self._rank = rank
        self._device = device
        self._all_on_device = device_predicates(device)[1]
        self._chunks: dict[tuple[int, int], list[_Chunk]] = {}  # per bucket, on first use
        self._sinks = sinks
        self._torch = torch

    def _tables(self, start: int, stop: int, sinks: SinkMap, torch: Any) -> list[_Chunk]:
        got = self._chunks.get((start, stop))
        if got is None:
            got = self._chunks[start, stop] = []
            idx = [i for i in range(start, stop)
                   if (s := sinks.get(self._plan.params[i].spec.name)) is not None
                   and s.in_place]
            for a in range(0, len(idx), _INLINE_PARAMS):
                part = idx[a:a + _INLINE_PARAMS]
                params = [self._plan.params[i] for i in part]
                got.append((part,
                            tuple(sinks[p.spec.name].tensor for p in params),
                            [getattr(torch, p.spec.dtype) for p in params],
                            [torch.Size(p.dst.local_shape(p.spec.shape, self._rank))
                             for p in params]))
        return got

    async def __call__(self, bucket: Bucket) -> None:
        """Raise ``PlanError`` naming the first of ``bucket``'s in-place targets that no
        longer has its planned dtype, local shape, contiguity or device."""
        on_device = self._all_on_device
        for a, (idx, ts, dtypes, shapes) in enumerate(
                self._tables(bucket.start, bucket.stop, self._sinks, self._torch)):
            if a:
                await anyio.lowlevel.checkpoint()
            if (all(map(operator.is_, map(_DTYPE, ts), dtypes))
                    and laid_out(ts, shapes, on_device)):
                continue
            self._explain(idx, ts)

    def _explain(self, idx: Sequence[int], ts: Sequence[Any]) -> None:
        for i, t in zip(idx, ts, strict=True):
            try:
                validate_local_buffer(self._plan.params[i], t, self._rank, "destination",
                                      device=self._device)
            except PlanError as exc:
                raise PlanError(f"{exc} (the target changed after connect: new storage "
                                f"must keep the planned dtype, shape, contiguity and "
                                f"device)") from None
