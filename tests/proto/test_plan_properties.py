"""Hypothesis properties of the plan geometry, checked against an independent torch model.

The model never uses ``Layout.box``: it derives each rank's shard with ``torch.chunk`` from the
row-major mesh definition, executes the pieces as copies between per-rank tensors, and counts
how often each destination element is written.
"""

from __future__ import annotations

import itertools
import math
from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2n_async import (
    REPLICATE,
    Layout,
    Mesh,
    ParamSpec,
    ParamTransfer,
    TransferPlan,
    complete_plan_digest,
    source_plan_digest,
)
from m2n_async._proto import plan as plan_mod
from m2n_async._proto.params import DTYPE_ITEMSIZE

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["bfloat16", "float32", "int8", "float64"]


@st.composite
def layouts(draw: st.DrawFn, start: int, size: int, ndim: int) -> Layout:
    d0 = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    mesh = Mesh((d0, size // d0), start)
    kind = draw(st.sampled_from(["replicated", "axis0", "axis1"]))
    if kind == "replicated" or ndim == 0:
        return Layout(mesh, None)
    dim = draw(st.integers(0, ndim - 1))
    return Layout(mesh, (dim, REPLICATE) if kind == "axis0" else (REPLICATE, dim))


@st.composite
def topologies(draw: st.DrawFn) -> tuple[int, int]:
    return draw(st.integers(1, 6)), draw(st.integers(1, 6))


@st.composite
def transfers(draw: st.DrawFn, t: int, n: int, name: str) -> ParamTransfer:
    ndim = draw(st.integers(1, 3))
    src = draw(layouts(0, t, ndim))
    dst = draw(layouts(t, n, ndim))
    shape = []
    for k in range(ndim):
        need = 1
        for lay in (src, dst):
            if lay.shard_dim == k:
                need = math.lcm(need, lay.num_shards)
        shape.append(need * draw(st.integers(1, 3)))
    return ParamTransfer(ParamSpec(name, draw(st.sampled_from(DTYPES)), tuple(shape), src), dst)


@st.composite
def plans(draw: st.DrawFn, max_params: int = 4) -> TransferPlan:
    t, n = draw(topologies())
    k = draw(st.integers(1, max_params))
    ps = [draw(transfers(t, n, f"p{i}")) for i in range(k)]
    return TransferPlan(ps, trainer_ranks=t, world_size=t + n)


# -- the independent model -------------------------------------------------------------------

def shard_index(lay: Layout, rank: int) -> int:
    i, j = divmod(rank - lay.mesh.start_rank, lay.mesh.dims[1])  # row-major by definition
    if lay.placements is None:
        return 0
    return i if lay.placements[0] != REPLICATE else j


def shard_count(lay: Layout) -> int:
    if lay.placements is None:
        return 1
    return lay.mesh.dims[0] if lay.placements[0] != REPLICATE else lay.mesh.dims[1]


def local(full: torch.Tensor, lay: Layout, rank: int) -> tuple[torch.Tensor, list[int]]:
    """The rank's shard (a view) and its global offset per dim."""
    if lay.placements is None:
        return full, [0] * full.dim()
    d = lay.placements[0] if lay.placements[0] != REPLICATE else lay.placements[1]
    idx = shard_index(lay, rank)
    chunk = full.chunk(shard_count(lay), dim=d)[idx]
    off = [0] * full.dim()
    off[d] = idx * chunk.shape[d]
    return chunk, off


def window(t: torch.Tensor, box: tuple[tuple[int, int], ...], off: list[int]) -> torch.Tensor:
    view = t[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, off, strict=True))]
    # slicing silently clips: insist the box lies inside the rank's shard
    assert tuple(view.shape) == tuple(hi - lo for lo, hi in box), (box, off, t.shape)
    return view


def ids_tensor(shape: tuple[int, ...], lay: Layout) -> torch.Tensor:
    ids = torch.empty(shape, dtype=torch.int64)
    for r in lay.mesh.ranks:
        view, _ = local(ids, lay, r)
        view.fill_(shard_index(lay, r))
    return ids


# -- properties ------------------------------------------------------------------------------

@SETTINGS
@given(plans(), st.sampled_from([1, 16, plan_mod.MIN_PIECE_BYTES]))
def test_pieces_cover_each_destination_box_exactly_once(plan: TransferPlan, floor: int) -> None:
    # Small floors make the water-fill cut pieces across replicas even in tiny tensors.
    with mock.patch.object(plan_mod, "MIN_PIECE_BYTES", floor):
        plan = TransferPlan(plan.params, trainer_ranks=plan.trainer_ranks,
                            world_size=plan.world_size)
        _check_coverage(plan)


def _check_coverage(plan: TransferPlan) -> None:
    for i, pt in enumerate(plan.params):
        spec, src, dst = pt.spec, pt.src, pt.dst
        full = torch.arange(spec.numel, dtype=torch.int64).reshape(spec.shape)
        got = {r: torch.full(local(full, dst, r)[0].shape, -1, dtype=torch.int64)
               for r in dst.mesh.ranks}
        hits = {r: torch.zeros_like(g) for r, g in got.items()}
        pieces = plan.pieces(i)
        assert list(pieces) == sorted(pieces)
        for p in pieces:
            assert src.mesh.contains(p.src_rank) and dst.mesh.contains(p.dst_rank)
            vol = math.prod(hi - lo for lo, hi in p.box)
            assert vol > 0 and p.nbytes == vol * DTYPE_ITEMSIZE[spec.dtype]
            s_local, s_off = local(full, src, p.src_rank)
            _, d_off = local(full, dst, p.dst_rank)
            window(got[p.dst_rank], p.box, d_off).copy_(window(s_local, p.box, s_off))
            window(hits[p.dst_rank], p.box, d_off).add_(1)
        for r in dst.mesh.ranks:
            assert torch.equal(hits[r], torch.ones_like(hits[r])), f"rank {r} coverage"
            assert torch.equal(got[r], local(full, dst, r)[0]), f"rank {r} content"


@SETTINGS
@given(plans())
def test_fan_in_and_out_match_brute_force(plan: TransferPlan) -> None:
    for i, pt in enumerate(plan.params):
        shape = pt.spec.shape
        src_ids, dst_ids = ids_tensor(shape, pt.src), ids_tensor(shape, pt.dst)
        fan_in = max(torch.unique(src_ids[dst_ids == k]).numel()
                     for k in range(shard_count(pt.dst)))
        fan_out = max(torch.unique(dst_ids[src_ids == k]).numel()
                      for k in range(shard_count(pt.src)))
        assert (plan.fan_in(i), plan.fan_out(i)) == (fan_in, fan_out)


@SETTINGS
@given(plans(max_params=6))
def test_bytes_sent_equal_bytes_received(plan: TransferPlan) -> None:
    send = [0] * plan.world_size
    recv = [0] * plan.world_size
    for i in range(len(plan)):
        for p in plan.pieces(i):
            send[p.src_rank] += p.nbytes
            recv[p.dst_rank] += p.nbytes
    for i in range(len(plan)):
        for r in range(plan.world_size):
            assert plan.pieces_from(i, r) == tuple(p for p in plan.pieces(i) if p.src_rank == r)
            assert plan.pieces_to(i, r) == tuple(p for p in plan.pieces(i) if p.dst_rank == r)
    assert [plan.send_bytes(r) for r in range(plan.world_size)] == send
    assert [plan.recv_bytes(r) for r in range(plan.world_size)] == recv
    assert sum(send) == sum(recv) == plan.total_bytes()
    # every destination rank receives every param's full shard
    for r in range(plan.trainer_ranks, plan.world_size):
        assert recv[r] == sum(math.prod(pt.dst.shard_shape(pt.spec.shape)) * pt.spec.itemsize
                              for pt in plan.params)
    assert all(send[r] == 0 for r in range(plan.trainer_ranks, plan.world_size))
    assert all(recv[r] == 0 for r in range(plan.trainer_ranks))
    peak = max(*send, *recv)
    assert plan.lower_bound_seconds(1e9) == peak / 1e9


@SETTINGS
@given(plans(max_params=3))
def test_replicas_share_a_source_shard_evenly(plan: TransferPlan) -> None:
    # Without the small-piece floor, every replica's load is within one slice of its quota.
    with mock.patch.object(plan_mod, "MIN_PIECE_BYTES", 1):
        p2 = TransferPlan(plan.params, trainer_ranks=plan.trainer_ranks,
                          world_size=plan.world_size)
        for i, pt in enumerate(p2.params):
            src, dst, shape = pt.src, pt.dst, pt.spec.shape
            item = pt.spec.itemsize
            for k in range(src.num_shards):
                reps = src.replicas(k)
                loads = dict.fromkeys(reps, 0)
                for p in p2.pieces(i):
                    if p.src_rank in loads:
                        loads[p.src_rank] += p.nbytes
                sbox = src.shard_box(shape, k)
                total, unit = 0, 0
                for j in range(dst.num_shards):
                    ov = plan_mod._intersect(sbox, dst.shard_box(shape, j))
                    if ov is None:
                        continue
                    nb = math.prod(hi - lo for lo, hi in ov) * item
                    total += nb * dst.num_replicas
                    unit = max(unit, nb // max(hi - lo for lo, hi in ov))
                quota = -(-total // len(reps))
                assert sum(loads.values()) == total
                assert max(loads.values()) <= quota + unit, (loads, quota, unit)


def test_large_replicated_source_is_split_across_replicas() -> None:
    src = Layout(Mesh((4, 1), 0), None)
    dst = Layout(Mesh((1, 1), 4), None)
    plan = TransferPlan([ParamTransfer(ParamSpec("w", "bfloat16", (4096, 1024), src), dst)],
                        trainer_ranks=4, world_size=5)
    assert [plan.send_bytes(r) for r in range(4)] == [2 << 20] * 4
    assert len(plan.pieces(0)) == 4


def test_small_replicated_params_rotate_over_replicas() -> None:
    src = Layout(Mesh((4, 1), 0), None)
    dst = Layout(Mesh((2, 1), 4), (0, REPLICATE))
    ps = [ParamTransfer(ParamSpec(f"norm{i}", "float32", (64,), src), dst) for i in range(8)]
    plan = TransferPlan(ps, trainer_ranks=4, world_size=6)
    # each small param comes whole from one replica, and consecutive params from the next one
    assert [{p.src_rank for p in plan.pieces(i)} for i in range(8)] == [{i % 4} for i in range(8)]
    assert [plan.send_bytes(r) for r in range(4)] == [512] * 4


@SETTINGS
@given(plans(max_params=6), st.integers(1, 4096))
def test_buckets_partition_the_plan_in_order(plan: TransferPlan, bucket_bytes: int) -> None:
    buckets = plan.buckets(bucket_bytes)
    assert buckets == plan.buckets(bucket_bytes)  # cached, identical
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert buckets[0].start == 0 and buckets[-1].stop == len(plan)
    costs = [plan.param_cost(i) for i in range(len(plan))]
    for a, b in itertools.pairwise(buckets):
        assert a.stop == b.start
        # greedy: the next param would not have fit
        assert a.nbytes + costs[b.start] > bucket_bytes
    for b in buckets:
        assert b.start < b.stop
        assert b.nbytes == sum(costs[b.start:b.stop])
        assert b.nbytes <= bucket_bytes or b.stop - b.start == 1
        # the cost bounds every rank's staging bytes in the bucket, both directions
        send = [0] * plan.world_size
        recv = [0] * plan.world_size
        for i in range(b.start, b.stop):
            for p in plan.pieces(i):
                send[p.src_rank] += p.nbytes
                recv[p.dst_rank] += p.nbytes
        assert max(*send, *recv) <= b.nbytes


# -- digests ---------------------------------------------------------------------------------

def _variants(pt: ParamTransfer) -> list[ParamSpec]:
    s = pt.spec
    out = [ParamSpec(s.name + "x", s.dtype, s.shape, s.layout),
           ParamSpec(s.name, "float16" if s.dtype != "float16" else "float32", s.shape,
                     s.layout),
           ParamSpec(s.name, s.dtype, (*s.shape, 1), s.layout)]
    other_start = Layout(Mesh(s.layout.mesh.dims, s.layout.mesh.start_rank + 1),
                         s.layout.placements)
    out.append(ParamSpec(s.name, s.dtype, s.shape, other_start))
    if s.layout.placements is not None:
        out.append(ParamSpec(s.name, s.dtype, s.shape, Layout(s.layout.mesh, None)))
    return out


@SETTINGS
@given(plans(max_params=4), st.data())
def test_digests_change_with_any_field_or_order(plan: TransferPlan, data: st.DataObject
                                                ) -> None:
    specs = list(plan.source_specs())
    t = plan.trainer_ranks
    d = source_plan_digest(specs, t)
    # stable: same content rebuilt from scratch, and after a wire round trip
    rebuilt = [ParamSpec(s.name, s.dtype, list(s.shape), Layout(Mesh(s.layout.mesh.dims),
               s.layout.placements)) for s in specs]
    assert source_plan_digest(rebuilt, t) == d
    assert complete_plan_digest(TransferPlan.from_record(plan.record())) == \
        complete_plan_digest(plan)
    assert source_plan_digest(specs, t + 1) != d
    i = data.draw(st.integers(0, len(specs) - 1))
    for v in _variants(plan.params[i]):
        changed = [*specs[:i], v, *specs[i + 1:]]
        assert source_plan_digest(changed, t) != d, v
    if len(specs) > 1:
        j = data.draw(st.integers(0, len(specs) - 1).filter(lambda j: j != i))
        swapped = list(specs)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        assert source_plan_digest(swapped, t) != d
        ps = list(plan.params)
        ps[i], ps[j] = ps[j], ps[i]
        assert complete_plan_digest(TransferPlan(ps, trainer_ranks=t,
                                                 world_size=plan.world_size)) != \
            complete_plan_digest(plan)
    # the destination layout is part of the complete digest only
    pt = plan.params[i]
    alt_dst = (Layout(pt.dst.mesh, None) if pt.dst.placements is not None
               else Layout(Mesh((1, pt.dst.mesh.size), pt.dst.mesh.start_rank), None))
    if alt_dst != pt.dst:
        ps = list(plan.params)
        ps[i] = ParamTransfer(pt.spec, alt_dst)
        p2 = TransferPlan(ps, trainer_ranks=t, world_size=plan.world_size)
        assert complete_plan_digest(p2) != complete_plan_digest(plan)
        assert source_plan_digest(p2.source_specs(), t) == d
    assert source_plan_digest(specs, t) != complete_plan_digest(plan)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 600), st.integers(1, 64))
def test_cuts_never_leave_pieces_below_the_floor(replicas: int, workers: int, rows: int,
                                                 cols: int) -> None:
    src = Layout(Mesh((replicas, 1), 0), None)
    dst = Layout(Mesh((workers, 1), replicas), None)
    shape = (rows, cols * 256)
    plan = TransferPlan([ParamTransfer(ParamSpec("w", "float32", shape, src), dst)],
                        trainer_ranks=replicas, world_size=replicas + workers)
    whole = rows * cols * 256 * 4
    floor = plan_mod.MIN_PIECE_BYTES
    for p in plan.pieces(0):
        assert p.nbytes >= floor or p.box == tuple((0, n) for n in shape), p
    loads = [plan.send_bytes(r) for r in range(replicas)]
    quota = max(-(-whole * workers // replicas), floor)
    assert sum(loads) == whole * workers
    assert max(loads) <= quota + max(2 * floor, whole // max(shape))


@SETTINGS
@given(plans(max_params=4))
def test_the_box_index_finds_what_testing_every_pair_finds(plan: TransferPlan) -> None:
    # The geometry looks up the destination shards a source shard meets through an index
    # (``_BoxIndex``); every pair tested in ascending order must give the same geometry,
    # water-fill included (it depends on the order of the needs).
    for pt in plan.params:
        shape, item = pt.spec.shape, pt.spec.itemsize
        d_boxes = [pt.dst.shard_box(shape, j) for j in range(pt.dst.num_shards)]
        index = plan_mod._BoxIndex(d_boxes)
        for k in range(pt.src.num_shards):
            sbox = pt.src.shard_box(shape, k)
            found = list(index.meeting(sbox))
            meets = [j for j, b in enumerate(d_boxes)
                     if plan_mod._intersect(sbox, b) is not None]
            assert found == sorted(found) and set(meets) <= set(found), (sbox, found, meets)
        fast = plan_mod._Geometry(shape, item, pt.src, pt.dst)
        with mock.patch.object(plan_mod._BoxIndex, "meeting",
                               lambda self, box: range(self._n)):
            every = plan_mod._Geometry(shape, item, pt.src, pt.dst)
        assert (fast.slot_pieces, fast.fan_in, fast.fan_out, fast.recv) == (
            every.slot_pieces, every.fan_in, every.fan_out, every.recv)


def test_the_box_index_narrows_aligned_and_staggered_shards() -> None:
    # 12 source slabs against 8 destination slabs of one dim: each source slab meets one or
    # two destination slabs, and only those are candidates; across dims, every one is.
    rows = 96
    src = Layout(Mesh((12, 1), 0), (0, REPLICATE))
    dst = Layout(Mesh((8, 1), 12), (0, REPLICATE))
    index = plan_mod._BoxIndex([dst.shard_box((rows, 4), j) for j in range(8)])
    assert [list(index.meeting(src.shard_box((rows, 4), k))) for k in range(12)] == [
        [0], [0, 1], [1], [2], [2, 3], [3], [4], [4, 5], [5], [6], [6, 7], [7]]
    cross = Layout(Mesh((8, 1), 12), (1, REPLICATE))
    index = plan_mod._BoxIndex([cross.shard_box((rows, 8), j) for j in range(8)])
    assert list(index.meeting(src.shard_box((rows, 8), 3))) == list(range(8))
