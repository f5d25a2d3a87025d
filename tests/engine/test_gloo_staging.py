"""The Gloo transport's staging, in one process: ``_pack`` on the trainers, an in-memory
"wire", ``_alloc_recv`` + ``_unpack`` on the workers — over several rounds, so that the views
cached per message and arena slot are reused, and with new source tensors and in-place
updates between rounds, so that a cache can never serve stale bytes. Plus the arena slots,
the cross-peer issue order, and a pack's memory: all it allocates is in ``Staging.nbytes``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2n_async._data._native import NativeThread
from m2n_async._data._transport import TransportContext, TransportSettings
from m2n_async._data.gloo import GlooStaging, GlooTransport, _Arenas
from m2n_async._engine._engine import MAX_BUCKET_PARAMS, split_buckets
from m2n_async._proto.plan import TransferPlan

from ._plans import R, expected_shards, make_plan, random_defs, source_shards


class _World:
    """Every rank's GlooTransport for ``plan`` (no process group: staging only)."""

    def __init__(self, plan: TransferPlan, bucket_bytes: int, max_inflight: int,
                 window: int = 0) -> None:
        self.plan = plan
        self.buckets = split_buckets(plan, plan.buckets(bucket_bytes), MAX_BUCKET_PARAMS)
        self.max_inflight = max_inflight
        # buckets staged at once; more than max_inflight makes slots collide, so buckets
        # land in other arenas than last round and the cached views must be rebuilt
        self.window = window or max_inflight
        self.threads: list[NativeThread] = []
        self.tr: dict[int, GlooTransport] = {}
        for r in range(plan.world_size):
            th = NativeThread(f"test-r{r}")
            self.threads.append(th)
            ctx = TransportContext(plan, r, 1, TransportSettings(max_inflight),
                                   th, self.buckets)
            t = GlooTransport(ctx)
            t._arenas = _Arenas(max(t._plan_all(), 1), max_inflight)
            self.tr[r] = t

    def close(self) -> None:
        for th in self.threads:
            th.close(5.0)

    def round(self, sources: dict[int, dict[str, torch.Tensor]],
              sinks: dict[int, dict[str, object]]) -> None:
        """Move every bucket, ``max_inflight`` staged at a time (like the pipeline)."""
        t = self.plan.trainer_ranks
        for w0 in range(0, len(self.buckets), self.window):
            window = self.buckets[w0:w0 + self.window]
            staged: list[tuple[dict[int, GlooStaging], dict[int, GlooStaging]]] = []
            for b in window:
                send = {r: self.tr[r]._pack(self.tr[r].packing(b), sources[r])
                        for r in range(t)}
                recv = {r: self.tr[r]._alloc_recv(self.tr[r].packing(b), sinks[r])  # type: ignore[arg-type]
                        for r in range(t, self.plan.world_size)}
                staged.append((send, recv))
            for send, recv in staged:
                _wire(send, recv)
                for r, st_ in recv.items():
                    self.tr[r]._unpack(st_, sinks[r])  # type: ignore[arg-type]
                for r, st_ in (*send.items(), *recv.items()):
                    self.tr[r].release(st_)


def _wire(send: dict[int, GlooStaging], recv: dict[int, GlooStaging]) -> None:
    """Match each pair's messages in order (as Gloo does) and copy the bytes across."""
    out: dict[tuple[int, int], list[torch.Tensor]] = {}
    for src, st_ in send.items():
        for peer, msg, buf, _ in st_.messages:
            assert buf.numel() == msg.nbytes
            out.setdefault((src, peer), []).append(buf)
    for dst, st_ in recv.items():
        for peer, msg, buf, _ in st_.messages:
            sent = out[(peer, dst)].pop(0)
            assert sent.numel() == buf.numel() == msg.nbytes, "sender and receiver disagree"
            buf.copy_(sent)
    assert all(not v for v in out.values()), "unreceived messages"


def _check_cached_views(world: _World) -> None:
    """Cached views only ever point into slot arenas: a temporary extra arena (a busy slot)
    must not be kept alive by a cache beyond the max_inflight bound."""
    for tr in world.tr.values():
        assert tr._arenas is not None
        slots = [(a.data_ptr(), a.data_ptr() + a.numel()) for a in tr._arenas._arenas.values()]
        assert tr._arenas.allocated == len(slots)  # every extra arena was released
        views = [d for c in tr._copy_cache.values() for d in c.dsts]
        views += [p for _, parts in tr._parts.values() for p in parts]
        views += [table._buf for up in tr._unpack_cache.values()
                  for _, table, _ in up.tables.values() if table is not None]
        views += [g[1]._buf for _, _, chunks in tr._gathers.values() for g in chunks
                  if g is not None and g[1]]
        for v in views:
            assert any(lo <= v.data_ptr() < hi for lo, hi in slots), "cached view of an extra"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _run(plan: TransferPlan, bucket_bytes: int, max_inflight: int,
         callback_every: int = 0, window: int = 0) -> None:
    """Three rounds: fresh sources, new tensor objects with new content, then the same
    objects updated in place. Every worker target bit-exact after each round; every
    ``callback_every``-th parameter is a load callback on the workers."""
    world = _World(plan, bucket_bytes, max_inflight, window)
    t, n = plan.trainer_ranks, plan.world_size
    names = [p.spec.name for p in plan.params]
    got: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(t, n)}

    def loader(r: int) -> Callable[[str, torch.Tensor], None]:
        def load(name: str, tensor: torch.Tensor) -> None:
            got[r][name] = tensor.clone()
        return load

    targets = {r: {k: torch.zeros_like(v) for k, v in expected_shards(plan, r).items()}
               for r in range(t, n)}
    sinks: dict[int, dict[str, object]] = {
        r: {name: (loader(r) if callback_every and k % callback_every == 0
                   else targets[r][name]) for k, name in enumerate(names)}
        for r in range(t, n)}
    try:
        sources = {r: source_shards(plan, r, version=1) for r in range(t)}
        for version in (1, 2, 3):
            if version == 2:  # new objects: nothing cached may refer to the old ones
                sources = {r: source_shards(plan, r, version=2) for r in range(t)}
            elif version == 3:  # the same objects, new bytes
                for r in range(t):
                    for k, v in source_shards(plan, r, version=3).items():
                        sources[r][k].copy_(v)
            world.round(sources, sinks)
            _check_cached_views(world)
            for r in range(t, n):
                for name, want in expected_shards(plan, r, version=version).items():
                    have = got[r][name] if callable(sinks[r][name]) else targets[r][name]
                    assert have.shape == want.shape, (version, r, name)
                    assert torch.equal(_bytes(have), _bytes(want)), (version, r, name)
    finally:
        world.close()


# Strided pieces (row -> column, experts EP -> TP) in the same messages as many small
# tensors, odd sizes (int8 of 3 then float32: a whole segment at an offset not aligned to
# its dtype), a 0-d tensor, bool.
_DEFS = [
    ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),
    ("w_col", (12, 6), torch.bfloat16, (R, 1), (R, 0)),
    *[(f"small.{k}", (3,) if k % 2 else (4,), torch.int8 if k % 2 else torch.float32,
       None, None) for k in range(12)],
    ("experts", (4, 6, 6), torch.float32, (R, 0), (R, 2)),
    ("scalar", (), torch.float64, None, None),
    ("flags", (6,), torch.bool, (R, 0), None),
    ("rep_to_shard", (6, 4), torch.float16, None, (R, 0)),
    ("same", (12, 4), torch.float32, (R, 0), (R, 0)),
]


def test_mixed_messages_bit_exact_over_rounds() -> None:
    plan = make_plan(_DEFS, (1, 2), (1, 3))
    for bucket_bytes, inflight in ((1 << 20, 1), (256, 2), (128, 3)):
        _run(plan, bucket_bytes, inflight)


# Many small parameters of a few sizes and dtypes in the same messages: the workers scatter
# them through address tables (``_hostcopy``), the odd ones beside them as before.
_TINY = [(f"t{k}", ((4,), (2, 3), (5,), (2, 2, 2))[k % 4],
          (torch.float32, torch.bfloat16, torch.int8, torch.float64)[k % 4],
          None, (R, 0) if k % 4 == 1 else None) for k in range(192)] + _DEFS


def test_many_small_parameters_go_through_address_tables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainers gather through a HostGather once their sources stay put (the third round:
    # the same objects as the second), the workers scatter through a HostScatter.
    plan = make_plan(_TINY, (1, 2), (1, 2))
    scatters: list[object] = []
    gathers: list[object] = []
    unpack, pack = GlooTransport._unpack, GlooTransport._pack

    def spy_unpack(self: GlooTransport, staged: GlooStaging, sinks: Any) -> None:
        unpack(self, staged, sinks)
        scatters.extend(t for up in self._unpack_cache.values()
                        for _, t, _ in up.tables.values() if t is not None)

    def spy_pack(self: GlooTransport, bp: Any, sources: Any) -> GlooStaging:
        got = pack(self, bp, sources)
        gathers.extend(g[1] for *_, chunks in self._gathers.values() for g in chunks
                       if g is not None and g[1])
        return got

    monkeypatch.setattr(GlooTransport, "_unpack", spy_unpack)
    monkeypatch.setattr(GlooTransport, "_pack", spy_pack)
    for bucket_bytes, inflight, window in ((1 << 20, 1, 0), (4096, 2, 0), (4096, 1, 3)):
        scatters.clear()
        _run(plan, bucket_bytes, inflight, window=window)
        assert scatters, (bucket_bytes, inflight, window)
    # packed messages made only of whole shards at offsets aligned to their dtypes (the
    # ones a trainer gathers)
    whole = make_plan([(f"w{k}", ((4,), (2, 4), (8,), (2, 2, 2))[k % 4],
                        (torch.float32, torch.bfloat16)[k % 2], None, None)
                       for k in range(192)], (1, 2), (1, 2))
    for bucket_bytes, inflight, window in ((1 << 20, 1, 0), (4096, 2, 0), (4096, 1, 3)):
        scatters.clear()
        gathers.clear()
        _run(whole, bucket_bytes, inflight, window=window)
        assert scatters and gathers, (bucket_bytes, inflight, window)


def test_buckets_moving_between_arenas_rebuild_their_views() -> None:
    plan = make_plan(_DEFS, (1, 2), (1, 3))
    for window in (2, 3, 4):  # staged at once, with only 1 arena slot
        _run(plan, 128, 1, window=window)


def test_load_callbacks_beside_cached_scatters() -> None:
    plan = make_plan(_DEFS, (1, 2), (1, 2))
    _run(plan, 256, 2, callback_every=3)


_PLACEMENTS = st.sampled_from([None, (R, 0), (R, 1), (R, 2), (0, R)])
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool,
                           torch.float64])


@st.composite
def _cases(draw: st.DrawFn) -> tuple[TransferPlan, int, int, int]:
    src_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3)]))
    dst_dims = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]))
    defs = random_defs(draw, _DTYPES, _PLACEMENTS, params=(1, 6), ndims=(0, 3))
    return (make_plan(defs, src_dims, dst_dims), draw(st.sampled_from([64, 512, 1 << 20])),
            draw(st.integers(1, 3)), draw(st.sampled_from([0, 2])))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_random_plans_bit_exact_over_rounds(case: tuple[TransferPlan, int, int, int]) -> None:
    _run(*case[:3], callback_every=case[3], window=case[2] + case[3] // 2)


def test_arena_slots_are_stable_and_bounded() -> None:
    a = _Arenas(64, 3)
    first = [a.acquire(10, i) for i in range(3)]
    assert a.allocated == 3 and len({x.data_ptr() for x in first}) == 3
    for x in first:
        a.release(x)
    # bucket i gets slot i % 3: the same arena every round
    again = [a.acquire(10, i) for i in range(3, 6)]
    assert [x.data_ptr() for x in again] == [x.data_ptr() for x in first]
    # a busy slot: an extra arena, dropped again on release
    extra = a.acquire(10, 0)
    assert extra.data_ptr() not in {x.data_ptr() for x in first} and a.allocated == 4
    a.release(extra)
    assert a.allocated == 3
    a.release(again[1])
    assert a.acquire(10, 0) is again[1]  # slot 0 busy, slot 1 free: reuse it
    try:
        a.acquire(65, 0)
    except Exception as exc:
        assert "exceeds the arena size" in str(exc)
    else:
        raise AssertionError("an oversized staging request was accepted")


def test_issue_order_interleaves_peers_and_keeps_each_pairs_order() -> None:
    plan = make_plan([("x", (4,), torch.float32, None, None)], (1, 1), (1, 2))
    bucket = plan.buckets(1 << 20)[0]
    st_ = GlooStaging(bucket)
    sizes = {1: [4, 4, 4, 4], 2: [16, 1, 1]}
    bufs = {p: [torch.empty(s, dtype=torch.uint8) for s in ss] for p, ss in sizes.items()}
    for p in (1, 2):  # plan order: all of peer 1, then all of peer 2
        for b in bufs[p]:
            st_.messages.append((p, None, b, False))  # type: ignore[arg-type]
    order = GlooTransport._issue_order(st_)
    assert [p for p, _ in order][:2] == [1, 2]  # both pairs start at once
    for p in (1, 2):
        assert [b for q, b in order if q == p] == bufs[p]  # per-pair order kept
    assert len(order) == 7


def test_a_cast_at_an_unaligned_offset_is_counted_in_the_staging(allocations: Any) -> None:
    # uint8 of 3 bytes first: the fp32 -> bf16 casts behind it start at odd offsets in the
    # packed message, so they go through temporaries; those are memory the bucket holds.
    plan = make_plan([("flag", (3,), torch.uint8, None, None),
                      ("odd", (6,), torch.bfloat16, None, None),
                      ("w", (4, 4), torch.bfloat16, (R, 0), (R, 1))], (1, 1), (1, 1))
    world = _World(plan, 1 << 20, 1)
    tr = world.tr[0]
    bp = tr.packing(world.buckets[0])
    src = {k: (v.float() if v.dtype == torch.bfloat16 else v)
           for k, v in source_shards(plan, 0, version=1).items()}
    want = torch.cat([_bytes(src["flag"]), _bytes(src["odd"].to(torch.bfloat16)),
                      _bytes(src["w"].to(torch.bfloat16))])
    try:
        tr.release(tr._pack(bp, src))  # the first cast grows the arena: allocated here
        with allocations() as alloc:
            staged = tr._pack(bp, src)
        assert staged.arena is not None
        assert alloc.nbytes == (6 + 16) * 2  # a temporary per unaligned cast, no more
        assert staged.nbytes == staged.arena.numel() + alloc.nbytes
        ((_, _, buf, direct),) = staged.messages
        assert not direct and torch.equal(buf, want)
        tr.release(staged)
        assert not staged.temps  # released with the arena
    finally:
        world.close()
