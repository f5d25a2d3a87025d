"""Casting while packing on the GPU lanes, on CPU over the FAKE nccl runtime.

A trainer's fp32 (or fp64) shards of bf16/fp16 parameters are cast by the transport while it
packs; the workers' bytes must equal ``shard.to(wire_dtype)`` exactly (round to nearest even),
for values that need rounding, exact ties, subnormals, infinities and NaN. The ``nccl`` lane
casts in its one multi-tensor packing copy (never a cast copy of the shard, never zero-copy
for a cast source) and counts the cast bytes in ``Staging.cast_bytes``; what its stage
allocates (the arena, the temporary of a cast at an unaligned offset) is ``Staging.nbytes``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from m2n_async._data._transport import Staging, Transport

from ._world import R, drive, local, make_plan, raise_first, run_world, targets

pytestmark = pytest.mark.asyncio

DEFS = [
    ("flag", (3,), torch.uint8, None, None),             # misaligns the next piece
    ("odd", (6,), torch.bfloat16, None, (R, 0)),
    ("w_row", (12, 8), torch.bfloat16, (R, 0), (R, 1)),   # strided on the worker
    ("w_col", (12, 8), torch.float16, (R, 1), (R, 0)),    # strided on the trainer
    ("w_same", (16, 8), torch.bfloat16, (R, 0), (R, 0)),  # one contiguous piece per peer
    ("scalar", (), torch.bfloat16, None, None),
    ("steps", (4,), torch.int32, None, (R, 0)),
]


def master(name: str, shape: tuple[int, ...], dtype: torch.dtype, version: int) -> torch.Tensor:
    """fp64 values (ints for int params) that mostly need rounding to the wire dtype."""
    g = torch.Generator().manual_seed(sum(name.encode()) * 131 + version)
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g, dtype=dtype)
    n = torch.Size(shape).numel()
    t = torch.randn(n, generator=g, dtype=torch.float64) * 50
    specials = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1e-40, float("inf"), float("nan"),
                             -0.0, 65520.0, 2.0**-25, 1.0 + 2**-11], dtype=torch.float64)
    k = min(n, len(specials))
    t[:k] = specials[:k]
    return t.reshape(shape)


def src_dtype(wire: torch.dtype) -> torch.dtype:
    return torch.float64 if wire == torch.float16 else torch.float32


def cast_sources(plan: Any, rank: int, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        wire = getattr(torch, p.spec.dtype)
        full = master(p.spec.name, p.spec.shape, wire, version)
        if wire.is_floating_point:
            full = full.to(src_dtype(wire))
        out[p.spec.name] = local(full, p.spec.layout, rank)
    return out


def cast_expected(plan: Any, rank: int, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        wire = getattr(torch, p.spec.dtype)
        full = master(p.spec.name, p.spec.shape, wire, version)
        if wire.is_floating_point:
            full = full.to(src_dtype(wire)).to(wire)
        out[p.spec.name] = local(full, p.dst, rank)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", ["nccl", "m2n"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 256], ids=["one-bucket", "many"])
async def test_cast_while_packing_bit_exact(fake_world: Any, name: str,
                                            bucket_bytes: int) -> None:
    plan = make_plan(DEFS, (1, 2), (1, 2))
    kept: dict[int, list[Staging]] = {}

    async def body(rank: int, t: Transport) -> None:
        trainer = rank < plan.trainer_ranks
        sinks = None if trainer else targets(plan, rank)
        for version in range(2):
            srcs = cast_sources(plan, rank, version) if trainer else None
            await drive(t, round=version, deadline=time.monotonic() + 30, sources=srcs,
                        sinks=sinks, max_inflight=2, keep=kept.setdefault(rank, []))
            if sinks is not None:
                for k, want in cast_expected(plan, rank, version).items():
                    assert same_bytes(sinks[k], want), (name, rank, version, k)

    raise_first(await run_world(name, plan, body=body, bucket_bytes=bucket_bytes))
    if name == "nccl":  # m2n counts its own (its stage casts with Tensor.to)
        for rank in range(plan.trainer_ranks):
            stagings = kept[rank]
            want = 2 * sum(piece.nbytes for i, p in enumerate(plan.params)
                           if p.spec.dtype in ("bfloat16", "float16")
                           for piece in plan.pieces_from(i, rank))
            assert sum(st.cast_bytes for st in stagings) == want > 0
            # the cast lands in the staging (at most what the bucket moves), no cast copies
            # of shards; only a cast at an unaligned offset adds a temporary of its size
            assert all(st.nbytes <= st.nbytes_moved + st.cast_bytes for st in stagings)


async def test_nccl_uncast_stays_zero_copy_beside_cast(fake_world: Any) -> None:
    # Only the fp32 source is staged; the bf16 one still goes zero-copy.
    plan = make_plan([("a", (16, 8), torch.bfloat16, (R, 0), (R, 0)),
                      ("b", (16, 8), torch.bfloat16, (R, 0), (R, 0))], (1, 2), (1, 2))
    kept: dict[int, list[Staging]] = {}

    async def body(rank: int, t: Transport) -> None:
        trainer = rank < plan.trainer_ranks
        srcs = sinks = None
        if trainer:
            srcs = cast_sources(plan, rank, 0)
            srcs["b"] = srcs["b"].to(torch.bfloat16)
        else:
            sinks = targets(plan, rank)
        await drive(t, round=0, deadline=time.monotonic() + 30, sources=srcs, sinks=sinks,
                    max_inflight=2, keep=kept.setdefault(rank, []))
        if sinks is not None:
            for k, want in cast_expected(plan, rank, 0).items():
                assert same_bytes(sinks[k], want), (rank, k)

    # One parameter per bucket, so that each peer buffer is one contiguous piece.
    raise_first(await run_world("nccl", plan, body=body, bucket_bytes=128))
    for rank in range(plan.trainer_ranks):
        a, b = kept[rank]
        assert (a.zero_copy, b.zero_copy) == (0, 1)  # type: ignore[attr-defined]
        assert a.cast_bytes == a.nbytes == 8 * 8 * 2 and (b.cast_bytes, b.nbytes) == (0, 0)


async def test_nccl_counts_the_temporary_of_an_unaligned_cast(fake_world: Any,
                                                              allocations: Any) -> None:
    # 3 bytes of uint8 first: the fp32 -> bf16 cast behind it starts at an odd offset of the
    # peer buffer and goes through a temporary, which the staging holds and counts.
    plan = make_plan([("flag", (3,), torch.uint8, None, None),
                      ("odd", (6,), torch.bfloat16, None, None)], (1, 1), (1, 1))
    seen: dict[str, int] = {}

    async def body(rank: int, t: Transport) -> None:
        t.begin_round(0, time.monotonic() + 30)
        try:
            (bucket,) = t.ctx.buckets
            if rank < plan.trainer_ranks:
                srcs = cast_sources(plan, rank, 0)
                with allocations() as alloc:  # stage does not yield: only this rank's ops
                    st = await t.stage(bucket, sources=srcs)
                seen.update(allocated=alloc.nbytes, nbytes=st.nbytes)
                await t.transfer(st).wait()
            else:
                sinks = targets(plan, rank)
                st = await t.stage(bucket, sinks=sinks)
                await t.transfer(st).wait()
                await t.unpack(st, sinks)
                for k, want in cast_expected(plan, rank, 0).items():
                    assert same_bytes(sinks[k], want), k
            t.release(st)
        finally:
            t.end_round()

    raise_first(await run_world("nccl", plan, body=body, bucket_bytes=1 << 20))
    assert seen["allocated"] == 3 + 12 + 12  # the arena, and the temporary of the cast
    assert seen["nbytes"] == seen["allocated"]
