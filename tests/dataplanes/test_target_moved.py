"""A worker target whose ``.data`` is reassigned between rounds gets the next round's bytes.

The lanes keep per-round work across rounds for speed: the Gloo lane receives straight into
cached views of its targets' bytes, the m2n lane scatters through cached device pointer tables
of its targets. The same tensor object with new storage behind it (``target.data = ...``, as
``Module.to`` does) must invalidate them; otherwise the bytes land in the old storage (on CUDA,
a block the caching allocator may have handed to another tensor already).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import pytest
import torch

from m2n_async._data import m2n as m2n_lane

from ._world import R, drive, expected, make_plan, raise_first, run_world, sources, targets

pytestmark = pytest.mark.asyncio

# A direct message (one contiguous range: received in place), a packed strided one, ten
# parameters of one geometry (one stacked m2n call, one scatter group) and forty small ones
# (on Gloo, scattered through an address table).
PLAN = make_plan([("big", (64, 32), torch.float32, (0, R), (0, R)),
                  ("col", (8, 8), torch.float32, (R, 0), (R, 1))]
                 + [(f"e{i}", (8, 4), torch.float32, (R, 0), (R, 1)) for i in range(10)]
                 + [(f"n{i}", (6,), torch.float32, None, None) for i in range(40)],
                 (1, 2), (1, 2))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


async def moved_targets_get_every_round(name: str) -> None:
    keep: list[torch.Tensor] = []  # the old storages stay alive: a stale write stays visible

    async def body(rank: int, t: Any) -> None:
        trainer = rank < PLAN.trainer_ranks
        mine = None if trainer else targets(PLAN, rank)
        bad = []
        for rnd in range(3):
            if mine is not None and rnd == 2:
                for k in mine:  # new storage behind the same tensor objects
                    keep.append(mine[k].data)
                    mine[k].data = torch.zeros_like(mine[k])
            await drive(t, round=rnd, deadline=time.monotonic() + 30,
                        sources=sources(PLAN, rank, rnd) if trainer else None,
                        sinks=mine, max_inflight=2)
            if mine is not None:
                bad += [(rnd, k) for k, v in expected(PLAN, rank, rnd).items()
                        if not same(mine[k], v)]
        assert not bad, f"{name} rank {rank}: stale or wrong target bytes in {bad}"

    raise_first(await run_world(name, PLAN, body=body, bucket_bytes=1 << 20,
                                host="127.0.0.1"))


async def test_gloo_receives_into_a_targets_new_storage() -> None:
    await moved_targets_get_every_round("gloo")


async def test_nccl_receives_into_a_targets_new_storage(fake_world: Any) -> None:
    await moved_targets_get_every_round("nccl")


async def test_m2n_scatters_into_a_targets_new_storage(fake_world: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU stand-in for the Triton copy (``_kernels``), as faithful as it needs to be here:
    # it copies through the pointer tables, as the kernel reads its pieces' base addresses.
    def pointer_table(tensors: Any, device: Any, ptrs: Any = None) -> list[int]:
        return [t.data_ptr() for t in tensors]

    def copy_many(dsts: Any, srcs: Any, *, src_table: Any = None, dst_table: Any = None,
                  uniform: bool = False) -> bool:
        if dsts[0].dtype != srcs[0].dtype:
            return False
        st = src_table if src_table is not None else pointer_table(srcs, None)
        dt = dst_table if dst_table is not None else pointer_table(dsts, None)
        n = srcs[0].numel() * srcs[0].element_size()
        for s, d in zip(st, dt, strict=True):
            ctypes.memmove(d, s, n)
        return True

    monkeypatch.setattr(m2n_lane, "kernels_available", lambda: True)
    monkeypatch.setattr(m2n_lane, "uniform_pieces",
                        lambda ts: all(t.is_contiguous() for t in ts))
    monkeypatch.setattr(m2n_lane, "pointer_table", pointer_table)
    monkeypatch.setattr(m2n_lane, "copy_many", copy_many)
    await moved_targets_get_every_round("m2n")
