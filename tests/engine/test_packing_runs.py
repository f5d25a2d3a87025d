"""``plan_bucket(split_runs=True)``: strided pieces cut into runs contiguous on both sides,
each moved zero-copy; bit-exact through an in-memory "wire" that, like the Gloo transport,
sends a direct message straight from the shard and receives it straight into the target."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2n_async._data._packing import (
    byte_view,
    flat_bytes,
    pack_segments,
    plan_bucket,
    unpack_segments,
)
from m2n_async._proto.plan import TransferPlan

from ._plans import R, expected_shards, make_plan, random_defs, source_shards


def _simulate(plan: TransferPlan, bucket_bytes: int, direct_min: int) -> int:
    """Move every bucket with ``split_runs``; return how many messages went zero-copy on both
    sides. Asserts both sides agree on every message's size and the result is bit-exact."""
    t, world = plan.trainer_ranks, plan.world_size
    sources = {r: source_shards(plan, r) for r in range(t)}
    targets = {r: {k: torch.full_like(v, 0) for k, v in expected_shards(plan, r).items()}
               for r in range(t, world)}
    names = [p.spec.name for p in plan.params]
    both_direct = 0
    for bucket in plan.buckets(bucket_bytes):
        wire: dict[tuple[int, int, int], tuple[torch.Tensor, bool]] = {}
        for r in range(t):
            bp = plan_bucket(plan, bucket, r, direct_min=direct_min, split_runs=True)
            for peer in bp.peers:
                for k, msg in enumerate(peer.messages):
                    seg = msg.direct
                    if seg is not None:
                        a, b = seg.span  # type: ignore[misc]
                        buf = flat_bytes(sources[r][names[seg.param]])[a:b]
                    else:
                        buf = torch.empty(msg.nbytes, dtype=torch.uint8)
                        pack_segments(buf, msg.segments,
                                      lambda i, r=r: byte_view(sources[r][names[i]]),
                                      msg.offset)
                    wire[(r, peer.peer, k)] = (buf, seg is not None)
        for r in range(t, world):
            bp = plan_bucket(plan, bucket, r, direct_min=direct_min, split_runs=True)
            views = {i: byte_view(targets[r][names[i]]) for i in bp.params}
            for peer in bp.peers:
                for k, msg in enumerate(peer.messages):
                    buf, sent_direct = wire.pop((peer.peer, r, k))
                    assert buf.numel() == msg.nbytes, "sender and receiver disagree on size"
                    seg = msg.direct
                    if seg is not None:
                        a, b = seg.span  # type: ignore[misc]
                        flat_bytes(targets[r][names[seg.param]])[a:b].copy_(buf)
                        both_direct += sent_direct
                    else:
                        unpack_segments(buf, msg.segments, views, msg.offset)
        assert not wire, f"unreceived buffers {sorted(wire)}"
    for r in range(t, world):
        for name, want in expected_shards(plan, r).items():
            got = targets[r][name]
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               want.reshape(-1).view(torch.uint8)), f"rank {r} param {name}"
    return both_direct


def test_experts_dim0_to_dim1_move_run_by_run() -> None:
    # (E, F, D) sharded on experts on the trainers, on F on the workers: each trainer's piece
    # for a worker is E/2 strided blocks of (F/2, D) — contiguous on both sides block by block.
    plan = make_plan([("experts", (4, 8, 16), torch.float32, (R, 0), (R, 1))], (1, 2), (1, 2))
    block = 4 * 16 * 4  # (F/2) x D x itemsize bytes
    bucket = plan.buckets(1 << 20)[0]
    for r in range(4):
        bp = plan_bucket(plan, bucket, r, direct_min=block, split_runs=True)
        for peer in bp.peers:
            assert len(peer.messages) == 2  # the piece's 2 experts, one run each
            assert all(m.direct is not None and m.nbytes == block for m in peer.messages)
        # without split_runs the trainer's side is strided: one packed message per peer
        bp = plan_bucket(plan, bucket, r, direct_min=block)
        if r < 2:
            assert all(m.direct is None for p in bp.peers for m in p.messages)
    assert _simulate(plan, 1 << 20, direct_min=block) == 8
    # runs below direct_min are not split (packing beats many tiny messages)
    assert _simulate(plan, 1 << 20, direct_min=block + 1) == 0


def test_row_to_column_not_split_and_mixed_bit_exact() -> None:
    plan = make_plan([
        ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),
        ("experts", (4, 6, 6), torch.float32, (R, 0), (R, 2)),
        ("experts2", (4, 6, 6), torch.bfloat16, (R, 0), (R, 1)),
        ("e3", (6, 4, 6), torch.int16, (R, 1), (R, 0)),
        ("rep_to_shard", (6, 4), torch.float16, None, (R, 0)),
        ("scalar", (), torch.float64, None, None),
    ], src_dims=(1, 2), dst_dims=(1, 3))
    for direct_min in (1, 8, 48, 1 << 20):
        _simulate(plan, 64, direct_min)
        _simulate(plan, 1 << 20, direct_min)


_PLACEMENTS = st.sampled_from([None, (R, 0), (R, 1), (R, 2), (0, R), (1, R)])
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool,
                           torch.float64])


@st.composite
def _plans(draw: st.DrawFn) -> tuple[TransferPlan, int, int]:
    src_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 3)]))
    dst_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)]))
    defs = random_defs(draw, _DTYPES, _PLACEMENTS, params=(1, 4))
    return (make_plan(defs, src_dims, dst_dims), draw(st.sampled_from([1, 256, 1 << 20])),
            draw(st.sampled_from([1, 6, 24, 48, 1 << 20])))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_random_plans_split_runs_bit_exact(case: tuple[TransferPlan, int, int]) -> None:
    _simulate(*case)
