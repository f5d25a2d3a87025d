"""The packing planner and executors: bit-exact through an in-memory "wire"."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2n_async._data._packing import (
    BucketPacking,
    byte_view,
    pack_segments,
    plan_bucket,
    unpack_segments,
)
from m2n_async._proto.plan import TransferPlan

from ._plans import R, expected_shards, make_plan, random_defs, source_shards


def _simulate(plan: TransferPlan, bucket_bytes: int, direct_min: int = 64) -> None:
    """Pack every message on every trainer, route by (src, dst, message), unpack on every
    worker, compare bit for bit with the reference shards."""
    t, world = plan.trainer_ranks, plan.world_size
    sources = {r: source_shards(plan, r) for r in range(t)}
    targets = {r: {k: torch.full_like(v, 0) for k, v in expected_shards(plan, r).items()}
               for r in range(t, world)}
    names = [p.spec.name for p in plan.params]
    for bucket in plan.buckets(bucket_bytes):
        wire: dict[tuple[int, int], torch.Tensor] = {}
        moved_out = 0
        for r in range(t):
            bp: BucketPacking = plan_bucket(plan, bucket, r, direct_min=direct_min)
            assert bp.sending
            for peer in bp.peers:
                assert sum(m.nbytes for m in peer.messages) == peer.nbytes
                for k, msg in enumerate(peer.messages):
                    buf = torch.empty(msg.nbytes, dtype=torch.uint8)
                    pack_segments(buf, msg.segments,
                                  lambda i, r=r: byte_view(sources[r][names[i]]), msg.offset)
                    wire[(r, peer.peer, k)] = buf
                    moved_out += msg.nbytes
        moved_in = 0
        for r in range(t, world):
            bp = plan_bucket(plan, bucket, r, direct_min=direct_min)
            assert not bp.sending
            views = {i: byte_view(targets[r][names[i]]) for i in bp.params}
            for peer in bp.peers:
                for k, msg in enumerate(peer.messages):
                    buf = wire.pop((peer.peer, r, k))
                    assert buf.numel() == msg.nbytes, "sender and receiver disagree on size"
                    unpack_segments(buf, msg.segments, views, msg.offset)
                    moved_in += msg.nbytes
        assert not wire, f"unreceived buffers {sorted(wire)}"
        assert moved_in == moved_out
    for r in range(t, world):
        for name, want in expected_shards(plan, r).items():
            got = targets[r][name]
            assert torch.equal(got.view(-1).view(torch.uint8) if got.dim() else got,
                               want.view(-1).view(torch.uint8) if want.dim() else want), \
                f"rank {r} param {name}"


def test_row_to_column_and_replicated() -> None:
    plan = make_plan([
        ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),
        ("w_col", (12, 6), torch.bfloat16, (R, 1), (R, 0)),
        ("rep_to_shard", (6, 4), torch.float16, None, (R, 0)),
        ("shard_to_rep", (6, 2), torch.int64, (R, 0), None),
        ("experts", (4, 6, 6), torch.float32, (R, 0), (R, 2)),
        ("flags", (6,), torch.bool, (R, 0), None),
        ("scalar", (), torch.float64, None, None),
    ], src_dims=(1, 2), dst_dims=(1, 3))
    _simulate(plan, bucket_bytes=64)
    _simulate(plan, bucket_bytes=1 << 20)
    _simulate(plan, bucket_bytes=1 << 20, direct_min=1 << 30)  # one message per peer
    _simulate(plan, bucket_bytes=1 << 20, direct_min=1)  # one message per piece


def test_zero_copy_detection() -> None:
    plan = make_plan([("a", (8, 4), torch.float32, (R, 0), (R, 0))], (1, 2), (1, 2))
    b = plan.buckets(1 << 20)[0]
    for r in range(4):
        bp = plan_bucket(plan, b, r)
        assert len(bp.peers) == 1 and bp.peers[0].direct is not None
    plan = make_plan([("a", (8, 4), torch.float32, (R, 0), (R, 1))], (1, 2), (1, 2))
    bp = plan_bucket(plan, plan.buckets(1 << 20)[0], 0)
    assert all(p.direct is None for p in bp.peers)  # column pieces of a row shard


_PLACEMENTS = st.sampled_from([None, (R, 0), (R, 1), (R, 2), (0, R), (1, R)])
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.int16,
                           torch.float64])


@st.composite
def _plans(draw: st.DrawFn) -> tuple[TransferPlan, int]:
    src_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 3)]))
    dst_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)]))
    defs = random_defs(draw, _DTYPES, _PLACEMENTS, params=(1, 4))
    return make_plan(defs, src_dims, dst_dims), draw(st.sampled_from([1, 256, 1 << 20]))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_random_plans_bit_exact(case: tuple[TransferPlan, int]) -> None:
    plan, bucket_bytes = case
    _simulate(plan, bucket_bytes, direct_min=48)


def test_kernel_groups_keep_one_dtype_pair_geometry_and_device_per_group() -> None:
    # The groups the Triton copy launches one by one (and the nccl lane foresees at
    # connect): pairs of one dtype pair, shape, strides and devices, in first-seen order,
    # each pair in exactly one group; and with the kernel declining (a CPU), every pair is
    # handed back to the caller.
    from m2n_async._data._packing import _copy_by_kernel, kernel_groups

    base = torch.zeros(8, 8)
    dsts = [torch.zeros(4, 4), torch.zeros(4, 4), base[:4, :4], torch.zeros(4, 4,
            dtype=torch.bfloat16), torch.zeros(2, 8)]
    srcs = [torch.ones(4, 4), torch.ones(4, 4), torch.ones(4, 4), torch.ones(4, 4),
            torch.ones(2, 8)]
    groups = kernel_groups(dsts, srcs)
    assert [len(gd) for gd, _ in groups] == [2, 1, 1, 1]  # strided, bf16, other shape apart
    assert [id(t) for gd, _ in groups for t in gd] == [id(t) for t in dsts]
    for gd, gs in groups:
        key = {(d.dtype, s.dtype, d.shape, d.stride(), s.stride())
               for d, s in zip(gd, gs, strict=True)}
        assert len(key) == 1
    rest_d, rest_s = _copy_by_kernel(dsts, srcs)
    assert sorted(map(id, rest_d)) == sorted(map(id, dsts))
    assert sorted(map(id, rest_s)) == sorted(map(id, srcs))
