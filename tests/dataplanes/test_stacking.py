"""Coalesced reshards: the pure stacking function, and the ``m2n`` lane stacking over the FAKE
nccl runtime (one collective per call, metadata checked identical on every rank).

The property tests check what every rank relies on: the calls of a bucket cover its
parameters exactly once, in an order every rank derives alike, and only parameters of one
geometry (rank <= 2, below the threshold, within the per-call limit) share a call. The lane
tests check bytes (bit-exact), call counts, zero-copy of the large, views for load callbacks
and that the setting is part of what the handshake compares.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2n_async import EngineConfig, TrainerEngine
from m2n_async._data._kernels import MIN_PIECES, Form
from m2n_async._data._transport import CheckedSources, Transport
from m2n_async._proto.plan import M2N_MAX_CALL_BYTES, TransferPlan
from m2n_async._proto.stacking import (
    COALESCE_BELOW_BYTES,
    bucket_calls,
    stack_problem,
    stacked_placement,
)
from m2n_async.testing import MemoryStore

from ._world import (
    R,
    drive,
    expected,
    forms_after_two_rounds,
    launched_form,
    make_plan,
    raise_first,
    run_world,
    sources,
    targets,
)

SHAPES = [(8, 4), (8,), (4, 8), (8, 4, 2), (16, 8)]
PAIRS = [((R, 0), (R, 1)), (None, (R, 0)), ((R, 1), None), ((R, 0), (R, 0))]
DTYPES = [torch.bfloat16, torch.float32]


def _plan(choices: list[tuple[int, int, int]]) -> TransferPlan:
    defs = []
    for k, (s, p, d) in enumerate(choices):
        shape = SHAPES[s]
        sp, dp = PAIRS[p]
        if len(shape) == 1:  # a 1-d tensor has no dim 1 to shard
            sp = None if sp is not None and sp[1] == 1 else sp
            dp = None if dp is not None and dp[1] == 1 else dp
        defs.append((f"p{k}", shape, DTYPES[d], sp, dp))
    return make_plan(defs, (1, 2), (1, 2))


plans = st.lists(st.tuples(st.integers(0, len(SHAPES) - 1), st.integers(0, len(PAIRS) - 1),
                           st.integers(0, len(DTYPES) - 1)), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(plans, st.sampled_from([1, 200, 1 << 20]), st.sampled_from([0, 100, 1 << 20]),
       st.sampled_from([64, 300, M2N_MAX_CALL_BYTES]))
def test_calls_partition_each_bucket_by_geometry(choices, bucket_bytes, below, max_call):
    plan = _plan(choices)
    again = TransferPlan.from_record(plan.record())  # what another rank builds
    for b in plan.buckets(bucket_bytes):
        calls = bucket_calls(plan, b, coalesce_below=below, max_call_bytes=max_call)
        assert calls == bucket_calls(again, b, coalesce_below=below, max_call_bytes=max_call)
        flat = [i for c in calls for i in c]
        assert sorted(flat) == list(range(b.start, b.stop))  # each param exactly once
        assert [c[0] for c in calls] == sorted(c[0] for c in calls)  # by first member
        for c in calls:
            assert list(c) == sorted(c)
            if len(c) == 1:
                continue
            first = plan.params[c[0]]
            for i in c:
                p = plan.params[i]
                assert (p.spec.shape, p.spec.dtype, p.src, p.dst) == (
                    first.spec.shape, first.spec.dtype, first.src, first.dst)
                assert stack_problem(plan, i, below) is None
                assert len(p.spec.shape) <= 2 and plan.param_cost(i) < below
            assert sum(plan.param_cost(i) for i in c) <= max_call


def test_what_is_never_stacked():
    plan = make_plan([("a", (8, 4, 2), torch.float32, (R, 0), (R, 1)),
                      ("b", (8, 4, 2), torch.float32, (R, 0), (R, 1)),
                      ("c", (8, 4), torch.float32, (R, 0), (R, 1)),
                      ("d", (8, 4), torch.bfloat16, (R, 0), (R, 1)),   # other dtype
                      ("e", (8, 4), torch.float32, (R, 1), (R, 1)),    # other source layout
                      ("f", (8, 4), torch.float32, (R, 0), (R, 0)),    # other destination
                      ("g", (4, 8), torch.float32, (R, 0), (R, 1))],   # other shape
                     (1, 2), (1, 2))
    b = plan.buckets(1 << 20)[0]
    calls = bucket_calls(plan, b, coalesce_below=1 << 20, max_call_bytes=1 << 30)
    assert calls == tuple((i,) for i in range(7))
    assert "tensor rank 3" in (stack_problem(plan, 0, 1 << 20) or "")
    assert stack_problem(plan, 2, 0) == "coalescing is off"
    assert "coalesce_below 32" in (stack_problem(plan, 2, 32) or "")  # costs 64 bytes


def test_a_group_over_the_call_limit_is_cut_in_order():
    plan = make_plan([(f"p{i}", (8, 4), torch.float32, (R, 0), (R, 1)) for i in range(5)]
                     + [("x", (4,), torch.float32, None, None)], (1, 2), (1, 2))
    b = plan.buckets(1 << 20)[0]
    cost = plan.param_cost(0)
    calls = bucket_calls(plan, b, coalesce_below=1 << 20, max_call_bytes=2 * cost)
    assert calls == ((0, 1), (2, 3), (4,), (5,))


def test_stacked_placement():
    assert [stacked_placement(x) for x in (R, 0, 1, 2)] == [R, 1, 2, 3]


# -- the m2n lane over the fake runtime ----------------------------------------------------


@pytest.mark.asyncio
async def test_experts_move_in_one_reshard_per_geometry(fake_world):
    # a MoE-like bucket: 3 geometries interleaved layer by layer, 8 experts each
    defs = []
    for e in range(8):
        defs += [(f"e{e}.gate", (16, 8), torch.bfloat16, (R, 0), (R, 0)),
                 (f"e{e}.down", (8, 16), torch.bfloat16, (R, 0), (R, 1)),
                 (f"e{e}.norm", (16,), torch.float32, None, None)]
    plan = make_plan(defs, (1, 2), (1, 2))
    results = await run_world("m2n", plan, bucket_bytes=1 << 20, rounds=2)
    raise_first(results)  # bit-exact on both workers, both rounds
    # probe (2) + 3 calls per round, on every rank
    assert set(fake_world.reshard_calls.values()) == {2 + 2 * 3}, fake_world.reshard_calls
    for res in results:
        st0 = res.stagings[0]
        assert st0.stacked_params == len(defs) and st0.zero_copy == 0
        assert st0.nbytes > 0  # the stacks are staging, counted against the bucket bound
        assert "stacked into one reshard" in res.transport.detail


@pytest.mark.asyncio
async def test_large_params_stay_single_and_zero_copy(fake_world):
    defs = [(f"big{i}", (64, 16), torch.bfloat16, (R, 0), (R, 0)) for i in range(3)]
    defs += [(f"small{i}", (8, 4), torch.bfloat16, (R, 0), (R, 0)) for i in range(3)]
    plan = make_plan(defs, (1, 2), (1, 2))
    below = plan.param_cost(0)  # the big ones cost exactly the threshold: not stacked
    results = await run_world("m2n", plan, bucket_bytes=1 << 20, coalesce_below=below)
    raise_first(results)
    assert set(fake_world.reshard_calls.values()) == {2 + 3 + 1}
    for res in results:
        assert res.stagings[0].zero_copy == 3, res.rank  # source shards / targets themselves
        assert res.stagings[0].stacked_params == 3


@pytest.mark.asyncio
async def test_load_callbacks_get_views_of_the_stack_in_plan_order(fake_world):
    # two geometries interleaved: the stacks' members must still reach callbacks in plan
    # order, as views (no copy) of the received stack
    defs = []
    for i in range(4):
        defs += [(f"a{i}", (8, 4), torch.float32, (R, 0), (R, 1)),
                 (f"b{i}", (4, 8), torch.float32, (R, 0), (R, 1))]
    plan = make_plan(defs, (1, 2), (1, 2))
    seen: dict[int, list[tuple[str, torch.Tensor, bool]]] = {2: [], 3: []}

    def sinks_for(rank, rnd):
        def cb(name, tensor):
            # a view of the received stack (in its arena), not a copy
            seen[rank].append((name, tensor.clone(), tensor._base is not None))
        return {p.spec.name: cb for p in plan.params}

    results = await run_world("m2n", plan, bucket_bytes=1 << 20, sinks_for=sinks_for)
    raise_first(results)
    for rank in (2, 3):
        assert [n for n, _, _ in seen[rank]] == [p.spec.name for p in plan.params]
        assert all(view for _, _, view in seen[rank])
        want = expected(plan, rank)
        for n, got, _ in seen[rank]:
            assert torch.equal(got, want[n]), (rank, n)


@pytest.mark.asyncio
async def test_fp32_masters_cast_into_the_stack(fake_world):
    defs = [(f"e{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1)) for i in range(6)]
    plan = make_plan(defs, (1, 2), (1, 2))
    results = await run_world("m2n", plan, bucket_bytes=1 << 20, src_dtype=torch.float32)
    raise_first(results)  # workers hold exactly source.to(bfloat16)
    for res in results[:2]:
        st0 = res.stagings[0]
        assert st0.stacked_params == 6
        assert st0.cast_bytes == st0.nbytes == 6 * 8 * 8 * 2  # 6 local (8, 8) bf16 shards


def test_coalescing_is_compared_in_the_handshake():
    def identity(cfg):
        e = TrainerEngine(params=[], store=MemoryStore(), owns_store=False, rank=0,
                          trainer_ranks=1, world_size=2, config=cfg)
        return dict(e._identity("m2n").env)

    on = identity(EngineConfig())
    assert on["m2n_async.coalesce"] == f"below {COALESCE_BELOW_BYTES}"
    assert identity(EngineConfig(coalesce=False))["m2n_async.coalesce"] == "off"
    assert identity(EngineConfig(coalesce_below=1 << 10))["m2n_async.coalesce"] == "below 1024"
    with pytest.raises(Exception, match="coalesce_below"):
        EngineConfig(coalesce_below=0)


@pytest.mark.asyncio
async def test_stack_arenas_and_descriptors_are_reused_across_rounds(fake_world):
    # Per round, unbind views, a descriptor per stack and the worker's scatter lists cost
    # more host time than the copies on 1024 experts: built once, reused while the arena
    # (one per pipeline slot) stays.
    defs = [(f"e{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1)) for i in range(6)]
    defs += [(f"n{i}", (8,), torch.float32, None, None) for i in range(3)]
    plan = make_plan(defs, (1, 2), (1, 2))
    seen: dict[int, tuple[set, list, set]] = {}

    async def body(rank, t):
        trainer = rank < plan.trainer_ranks
        mine = None if trainer else targets(plan, rank)
        for rnd in range(4):
            await drive(t, round=rnd, deadline=time.monotonic() + 30,
                        sources=sources(plan, rank, rnd) if trainer else None, sinks=mine,
                        max_inflight=2)
            if not trainer:
                for k, v in expected(plan, rank, rnd).items():
                    assert torch.equal(mine[k].view(torch.uint8), v.view(torch.uint8))
        seen[rank] = (set(t._views), sorted(t._own_side), set(t._scatter))

    results = await run_world("m2n", plan, bucket_bytes=1 << 20, body=body)
    raise_first(results)
    for rank, (views, own, scatter) in seen.items():
        assert views == {0}
        # both stacks' own-side descriptors kept (the arena views are the same objects)
        assert own == [0, 6], (rank, own)
        assert scatter == ({0} if rank >= 2 else set())


def test_a_busy_arena_slot_gets_a_temporary_buffer():
    from m2n_async._data.m2n import _StackArenas

    arenas = _StackArenas(2)
    s0, a0 = arenas.take(0, 100, "cpu")
    s1, _ = arenas.take(1, 100, "cpu")
    assert (s0, s1) == (0, 1)
    s2, tmp = arenas.take(2, 100, "cpu")  # slot 0 still busy: not reused
    assert s2 is None and tmp.data_ptr() != a0.data_ptr()
    arenas.give(s0)
    s3, again = arenas.take(2, 50, "cpu")  # free again: the same arena, big enough
    assert s3 == 0 and again.data_ptr() == a0.data_ptr()
    arenas.give(s3)
    s4, bigger = arenas.take(0, 400, "cpu")
    assert s4 == 0 and bigger.numel() == 400


def test_the_gpu_kernel_declines_cpu_tensors():
    # the Triton copy is GPU-only and optional: on CPU (or without Triton) it does nothing
    # and says so, and the lane copies with torch._foreach_copy_ (every test above)
    from m2n_async._data._kernels import copy_many

    dsts = [torch.empty(4, 4) for _ in range(16)]
    srcs = [torch.ones(4, 4) for _ in range(16)]
    assert copy_many(dsts, srcs) is False


@pytest.mark.asyncio
async def test_a_missing_member_target_names_the_parameter(fake_world):
    # a worker whose sinks lack one member of a stacked call fails staging, before the
    # transfer, naming that member (the others are looked up in one call)
    defs = [(f"e{i}", (8, 4), torch.float32, (R, 0), (R, 1)) for i in range(6)]
    plan = make_plan(defs, (1, 2), (1, 2))

    def sinks_for(rank, rnd):
        got = dict(targets(plan, rank))
        if rank == 2:
            del got["e3"]
        return got

    results = await run_world("m2n", plan, bucket_bytes=1 << 20, sinks_for=sinks_for,
                              deadline=1.5)  # the others wait out the round's deadline
    err = results[2].error
    assert err is not None and "parameter 'e3' is missing from this rank's tensors" in str(err)


@pytest.mark.asyncio
async def test_copy_forms_are_the_copies_the_round_launches(fake_world, monkeypatch):
    # What the lane compiles at connect (``_copy_forms``, warmed on a GPU with Triton) must
    # be every multi-tensor copy a round launches: the stacks' packs from wire-dtype and
    # fp32 sources (trainers) and the scatters into the targets written in place, one per
    # member shape across a bucket's stacks (workers), each at its pieces' alignment. The
    # copies are recorded where the lane calls ``copy_many`` (doubles make the worker take
    # the kernel path on the CPU; the recorder declines, so ``_foreach_copy_`` moves the
    # bytes).
    from m2n_async._data import m2n as m2n_plane

    defs = []
    for e in range(8):
        defs += [(f"e{e}.gate", (16, 8), torch.bfloat16, (R, 0), (R, 0)),
                 (f"e{e}.down", (8, 16), torch.bfloat16, (R, 0), (R, 1)),
                 (f"e{e}.odd", (6,), torch.bfloat16, None, None),    # 12-byte members
                 (f"e{e}.norm", (16,), torch.float32, None, None)]
    defs += [(f"few{i}", (4, 4), torch.bfloat16, None, None) for i in range(3)]  # < 8: foreach
    plan = make_plan(defs, (1, 2), (1, 2))
    # load callbacks on the workers: 5 gates (their 3 others scatter with the 8 downs, whose
    # members have the same shape) and 2 odds (6 left: fewer than a kernel copy takes)
    callback = {f"e{e}.gate" for e in range(5)} | {"e0.odd", "e1.odd"}
    index = {p.spec.name: i for i, p in enumerate(plan.params)}
    in_place = frozenset(i for n, i in index.items() if n not in callback)
    rank_of: contextvars.ContextVar[int] = contextvars.ContextVar("rank")  # a task per rank
    launched: dict[int, set[Form]] = {}

    def recording(dsts: Any, srcs: Any, **kw: Any) -> bool:
        if len(dsts) >= MIN_PIECES:
            launched.setdefault(rank_of.get(), set()).add(launched_form(dsts, srcs))
        return False

    monkeypatch.setattr(m2n_plane, "copy_many", recording)
    monkeypatch.setattr(m2n_plane, "kernels_available", lambda: True)
    monkeypatch.setattr(m2n_plane, "uniform_pieces", lambda ts: True)
    got: dict[int, list[Form]] = {}

    body = forms_after_two_rounds(plan, callback, rank_of, got)
    raise_first(await run_world("m2n", plan, bucket_bytes=1 << 20, body=body,
                                in_place={2: in_place, 3: in_place}))
    assert sorted(got) == sorted(launched) == [0, 1, 2, 3]
    for r, forms in got.items():
        assert len(forms) == len(set(forms))
        assert set(forms) == launched[r], (r, set(forms) ^ launched[r])
        if r < 2:  # gate, down and odd in bf16 and from fp32, norm; odd's 12-byte members
            assert len(forms) == 7 and {f.align for f in forms} == {4, 16}, (r, forms)
        else:  # the (8, 8) members of gate and down as one scatter, norm; too few odds
            assert len(forms) == 2 and {f.shape for f in forms} == {(8, 8), (16,)}, (r, forms)


@pytest.mark.asyncio
@pytest.mark.parametrize("lane", ["m2n", "gloo"])
@pytest.mark.parametrize("src_dtype", [None, torch.float32])
async def test_checked_sources_are_read_by_plan_index(fake_world, lane, src_dtype):
    """With the engine's ``CheckedSources`` the lanes take each shard and its dtype by plan
    index (no lookup by name): the workers still get every parameter bit-exact, stacked
    geometries interleaved, fp32 masters cast on the way; the lane reads the checked
    sources only for the mapping they were made from."""
    # Gloo reads them where a message is made of whole shards: layouts alike on both sides
    other = (R, 1) if lane == "m2n" else (R, 0)
    defs = []
    for e in range(20):  # more than a gather table's minimum of segments per message
        defs += [(f"e{e}.gate", (16, 8), torch.bfloat16, (R, 0), other),
                 (f"e{e}.down", (8, 16), torch.bfloat16, (R, 0), (R, 0)),
                 (f"e{e}.norm", (4,), torch.bfloat16, None, None)]
    plan = make_plan(defs, (1, 2), (1, 2))
    read: list[bool] = []
    real = Transport.for_sources

    def spying(self, srcs):
        got = real(self, srcs)
        read.append(got is not None)
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Transport, "for_sources", spying)
        results = await run_world(lane, plan, bucket_bytes=1 << 20, rounds=2,
                                  src_dtype=src_dtype, checked=True,
                                  host="127.0.0.1" if lane == "gloo" else None)
    raise_first(results)  # bit-exact on both workers, both rounds
    assert read and all(read)


def test_checked_sources_serve_only_their_own_mapping() -> None:
    from m2n_async._data.gloo import GlooTransport

    t: Transport = GlooTransport.__new__(GlooTransport)  # no lane: the base's bookkeeping
    t._checked = None
    mine: dict[str, torch.Tensor] = {"a": torch.zeros(2)}
    checked = CheckedSources(mine, [mine["a"]], [torch.float32])
    assert t.for_sources(mine) is None
    t.use_checked(checked)
    assert t.for_sources(mine) is checked
    assert t.for_sources(dict(mine)) is None  # an equal mapping is not the one checked
    t.use_checked(None)
    assert t.for_sources(mine) is None
