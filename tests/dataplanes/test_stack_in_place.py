"""Stacked reshards over the caller's own bytes: members back to back in one storage.

When a stacked call's members are, in stack order, adjacent views of one storage (a trainer's
flat parameter buffer; experts addressed as ``w[e]`` of one stacked weight), the ``m2n`` lane
sends from and receives into that storage itself: no pack copy, no scatter, no arena. These
tests run the lane over the FAKE nccl runtime and check the bytes, that the in-place path is
taken exactly where it may be, and that it is left again (with the bytes still right) when the
tensors stop lying back to back.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch

from ._world import R, drive, expected, make_plan, raise_first, run_world, sources, targets

pytestmark = pytest.mark.asyncio

EXPERTS = 8
# 8 experts of one geometry (one stacked call) and two norms of different shapes (single,
# zero-copy calls)
PLAN = make_plan([(f"e{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1)) for i in range(EXPERTS)]
                 + [("n0", (8,), torch.float32, None, None),
                    ("n1", (4,), torch.float32, None, None)],
                 (1, 2), (1, 2))
# norms of one shape first, then the experts: two stacked calls, the first never in place
# (own targets)
TWO_STACKS = make_plan([(f"n{i}", (8,), torch.float32, None, None) for i in range(2)]
                       + [(f"e{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1))
                          for i in range(EXPERTS)],
                       (1, 2), (1, 2))
STACKED = [f"e{i}" for i in range(EXPERTS)]


def flat_views(like: dict[str, torch.Tensor], names: list[str], *, gap: int = 0,
               fill: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One buffer holding ``names`` back to back (``gap`` spare elements after each), in
    that order, as views; the other entries of ``like`` stay their own tensors."""
    first = like[names[0]]
    per = first.numel() + gap
    buf = torch.zeros(per * len(names), dtype=first.dtype)
    out = dict(like)
    for i, n in enumerate(names):
        view = buf[i * per:i * per + first.numel()].view(first.shape)
        if fill:
            view.copy_(like[n])
        out[n] = view
    return buf, out


def own_objects(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stacked members as tensor objects of their own given their views through
    ``.data`` (as Megatron's DDP does with its parameters), not as views."""
    out = dict(views)
    for n in STACKED:
        out[n] = torch.empty(0, dtype=views[n].dtype)
        out[n].data = views[n]
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


async def run(src_of: Any, dst_of: Any, rounds: int = 3, plan: Any = PLAN
              ) -> dict[int, list[Any]]:
    """``rounds`` rounds; ``src_of(rank, rnd)`` / ``dst_of(rank, rnd, last)`` give each
    round's sources / targets. Returns the stagings of each rank, checked bit-exact."""
    kept: dict[int, list[Any]] = {}

    async def body(rank: int, t: Any) -> None:
        trainer = rank < plan.trainer_ranks
        mine: dict[str, torch.Tensor] | None = None
        kept[rank] = []
        for rnd in range(rounds):
            if not trainer:
                mine = dst_of(rank, rnd, mine)
            await drive(t, round=rnd, deadline=time.monotonic() + 30,
                        sources=src_of(rank, rnd) if trainer else None, sinks=mine,
                        max_inflight=2, keep=kept[rank])
            if mine is not None:
                bad = [k for k, v in expected(plan, rank, rnd).items() if not same(mine[k], v)]
                assert not bad, f"rank {rank} round {rnd}: {bad} differ"
        # what the lane holds after the last round (``close`` clears it all)
        kept[rank].append({"arenas": len(t._arenas._bufs), "scatter": len(t._scatter),
                           "own": sorted(t._own_side), "spans checked": len(t._spans)})

    raise_first(await run_world("m2n", plan, body=body, bucket_bytes=1 << 20))
    return kept


def flat_sources(rank: int, rnd: int, plan: Any = PLAN) -> dict[str, torch.Tensor]:
    return flat_views(sources(plan, rank, rnd), STACKED)[1]


async def test_stacks_in_one_buffer_move_in_place(fake_world: Any) -> None:
    held: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    # trainers: persistent flat buffers refilled each round (an optimizer's parameters)
    src: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        fresh = sources(PLAN, rank, rnd)
        if rank not in src:
            src[rank] = flat_views(fresh, STACKED)
        for n, v in src[rank][1].items():
            v.copy_(fresh[n])
        return src[rank][1]

    def dst_of(rank: int, rnd: int, last: Any) -> dict[str, torch.Tensor]:
        if rank not in held:
            held[rank] = flat_views(targets(PLAN, rank), STACKED, fill=False)
        return held[rank][1]

    kept = await run(src_of, dst_of)
    for rank, stagings in kept.items():
        held_by_lane = stagings.pop()
        for st in stagings:
            assert st.in_place_stacks == 1 and st.stacked_params == EXPERTS, rank
            assert st.zero_copy == 2 and st.nbytes == 0, rank  # no staging at all
        assert held_by_lane == {"arenas": 0, "scatter": 0,  # no arena taken, nothing to scatter
                                "own": [0, 8, 9],  # every own-side descriptor is reused
                                "spans checked": 1}, rank
    for rank, (buf, _views) in held.items():  # the bytes are in the worker's own buffer
        want = expected(PLAN, rank, 2)
        assert same(buf, torch.cat([want[n].reshape(-1) for n in STACKED]))


def adjacent_allocations(like: dict[str, torch.Tensor], names: list[str]
                         ) -> dict[str, torch.Tensor]:
    """``names`` back to back in memory, but each its own storage (two allocations that
    happen to touch): one reshard over all of them would cross storage bounds."""
    first = like[names[0]]
    per = first.numel() * first.element_size()
    raw = memoryview(bytearray(per * len(names)))
    out = dict(like)
    for i, n in enumerate(names):
        t = torch.frombuffer(raw[i * per:(i + 1) * per], dtype=first.dtype).view(first.shape)
        t.copy_(like[n])
        out[n] = t
    return out


@pytest.mark.parametrize("layout", ["separate", "gap", "reversed", "half", "two allocations"])
async def test_members_not_back_to_back_are_packed(fake_world: Any, layout: str) -> None:
    def arrange(like: dict[str, torch.Tensor], fill: bool) -> dict[str, torch.Tensor]:
        if layout == "separate":
            return like
        if layout == "two allocations":
            return adjacent_allocations(like, STACKED)
        if layout == "gap":  # one spare element after each member
            return flat_views(like, STACKED, gap=1, fill=fill)[1]
        if layout == "reversed":  # back to back, but the last member first
            return flat_views(like, STACKED[::-1], fill=fill)[1]
        return flat_views(like, STACKED[:EXPERTS // 2], fill=fill)[1]  # half of them only

    kept = await run(lambda rank, rnd: arrange(sources(PLAN, rank, rnd), True),
                     lambda rank, rnd, last: last or arrange(targets(PLAN, rank), False))
    for rank, stagings in kept.items():
        stagings.pop()
        assert all(st.in_place_stacks == 0 and st.stacked_params == EXPERTS
                   for st in stagings), rank


async def test_fp32_masters_in_one_buffer_are_cast_into_the_stack(fake_world: Any) -> None:
    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        return flat_views(sources(PLAN, rank, rnd, torch.float32), STACKED)[1]

    kept: dict[int, list[Any]] = {}

    async def body(rank: int, t: Any) -> None:
        trainer = rank < PLAN.trainer_ranks
        mine = None if trainer else targets(PLAN, rank)
        kept[rank] = []
        await drive(t, round=0, deadline=time.monotonic() + 30,
                    sources=src_of(rank, 0) if trainer else None, sinks=mine,
                    max_inflight=2, keep=kept[rank])
        if mine is not None:
            for k, v in expected(PLAN, rank, 0, via=torch.float32).items():
                assert same(mine[k], v), (rank, k)

    raise_first(await run_world("m2n", PLAN, body=body, bucket_bytes=1 << 20))
    for rank in (0, 1):
        (st,) = kept[rank]
        assert st.in_place_stacks == 0 and st.cast_bytes > 0, rank


@pytest.mark.parametrize("plan", [PLAN, TWO_STACKS], ids=["one stack", "two stacks"])
async def test_targets_leaving_and_rejoining_one_buffer(fake_world: Any, plan: Any) -> None:
    # round 0: targets in one buffer (in place); rounds 1 and 3: the same tensor objects get
    # storage of their own (scatter); rounds 2 and 4: a new shared buffer again (in place).
    # With two stacks, the other one is scattered every round: the scatter kept from the
    # round before must not be reused when the set of scattered stacks changed. Old buffers
    # stay alive: a write through a stale address would stay visible.
    old: dict[int, list[torch.Tensor]] = {}

    def dst_of(rank: int, rnd: int, last: Any) -> dict[str, torch.Tensor]:
        if last is None:
            buf, views = flat_views(targets(plan, rank), STACKED, fill=False)
            old[rank] = [buf]
            return views
        if rnd % 2:
            for n in STACKED:
                last[n].data = torch.zeros_like(last[n])
        else:
            buf, fresh = flat_views(targets(plan, rank), STACKED, fill=False)
            old[rank].append(buf)
            for n in STACKED:
                last[n].data = fresh[n]
        return last

    kept = await run(lambda rank, rnd: flat_sources(rank, rnd, plan), dst_of, rounds=5,
                     plan=plan)
    for rank in (2, 3):
        stagings = kept[rank][:-1]
        assert [st.in_place_stacks for st in stagings] == [1, 0, 1, 0, 1], rank
        # each shared buffer holds the bytes of the last round it was the targets', untouched
        # by the rounds after
        for buf, rnd in zip(old[rank], (0, 2, 4), strict=True):
            want = expected(plan, rank, rnd)
            assert same(buf, torch.cat([want[n].reshape(-1) for n in STACKED])), (rank, rnd)


async def test_fresh_buffers_each_round_are_not_kept(fake_world: Any) -> None:
    # sources built anew every round (a lazy cast into a fresh flat buffer): nothing the
    # lane builds over them (the stack's view, its descriptor) may outlive the round, or it
    # would hold the storage the caller dropped
    from torch.multiprocessing.reductions import StorageWeakRef

    dropped: dict[int, list[Any]] = {}

    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        gc.collect()
        alive = [r for r in dropped.setdefault(rank, []) if not r.expired()]
        assert not alive, f"rank {rank} round {rnd}: {len(alive)} earlier buffers held"
        buf, views = flat_views(sources(PLAN, rank, rnd), STACKED)
        dropped[rank].append(StorageWeakRef(buf.untyped_storage()))
        return views

    kept = await run(src_of, lambda rank, rnd, last: last or targets(PLAN, rank), rounds=4)
    for rank in (0, 1):
        assert all(st.in_place_stacks == 1 for st in kept[rank][:-1]), rank
        assert kept[rank][-1]["spans checked"] == 1, rank


def one_storage(like: dict[str, torch.Tensor], names: list[str], lead: int, fill: bool
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``names`` back to back as ``dtype`` views of a uint8 buffer, ``lead`` bytes in: the
    stack's view must start at the first member's storage offset, not at the storage's."""
    first = like[names[0]]
    per = first.numel() * first.element_size()
    buf = torch.zeros(lead + per * len(names), dtype=torch.uint8)
    out = dict(like)
    for i, n in enumerate(names):
        view = buf[lead + i * per:lead + (i + 1) * per].view(first.dtype).view(first.shape)
        if fill:
            view.copy_(like[n])
        out[n] = view
    return buf, out


async def test_a_stack_inside_a_buffer_of_another_dtype_at_an_offset(fake_world: Any) -> None:
    src: dict[int, dict[str, torch.Tensor]] = {}
    dst: dict[int, dict[str, torch.Tensor]] = {}

    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        fresh = sources(PLAN, rank, rnd)
        if rank not in src:
            src[rank] = one_storage(fresh, STACKED, 512, True)[1]
        for n, v in src[rank].items():
            v.copy_(fresh[n])
        return src[rank]

    def dst_of(rank: int, rnd: int, last: Any) -> dict[str, torch.Tensor]:
        if rank not in dst:
            dst[rank] = one_storage(targets(PLAN, rank), STACKED, 256, False)[1]
        return dst[rank]

    kept = await run(src_of, dst_of)
    for rank in range(4):
        assert [st.in_place_stacks for st in kept[rank][:-1]] == [1, 1, 1], rank


async def test_targets_given_own_storage_at_the_same_addresses(fake_world: Any) -> None:
    # Round 0: the targets are views of one storage (in place). Round 1: every target gets a
    # storage of its own at the very same addresses (the caching allocator can split a freed
    # block exactly so; here, separate buffers over one bytearray). A stack over them would
    # cross storage bounds: round 1 must scatter, with the bytes right.
    raws: dict[int, memoryview] = {}

    def dst_of(rank: int, rnd: int, last: Any) -> dict[str, torch.Tensor]:
        like = targets(PLAN, rank)
        per = like[STACKED[0]].numel() * like[STACKED[0]].element_size()
        if last is None:
            raws[rank] = raw = memoryview(bytearray(per * EXPERTS))
            whole = torch.frombuffer(raw, dtype=like[STACKED[0]].dtype)
            n = like[STACKED[0]].numel()
            return {**like, **{name: whole[i * n:(i + 1) * n].view(like[name].shape)
                               for i, name in enumerate(STACKED)}}
        raw = raws[rank]
        for i, name in enumerate(STACKED):
            own = torch.frombuffer(raw[i * per:(i + 1) * per], dtype=last[name].dtype)
            last[name].data = own.view(last[name].shape)
        return last

    kept = await run(flat_sources, dst_of, rounds=2)
    for rank in (2, 3):
        assert [st.in_place_stacks for st in kept[rank][:-1]] == [1, 0], rank


async def test_a_span_is_forgotten_when_the_sources_need_a_cast(fake_world: Any) -> None:
    # rounds 0-2: bf16 sources in one buffer, sent in place (the span checked in full once);
    # round 3: fp32 masters, packed with the cast. Nothing of the bf16 buffer's stays
    # recorded: a later round over it is checked in full again.
    bufs: dict[int, dict[str, torch.Tensor]] = {}

    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        if rnd == 3:
            return sources(PLAN, rank, rnd, torch.float32)
        fresh = sources(PLAN, rank, rnd)
        if rank not in bufs:
            bufs[rank] = flat_views(fresh, STACKED)[1]
        for n, v in bufs[rank].items():
            v.copy_(fresh[n])
        return bufs[rank]

    kept: dict[int, list[Any]] = {}

    async def body(rank: int, t: Any) -> None:
        trainer = rank < PLAN.trainer_ranks
        mine = None if trainer else targets(PLAN, rank)
        kept[rank] = []
        for rnd in range(4):
            await drive(t, round=rnd, deadline=time.monotonic() + 30,
                        sources=src_of(rank, rnd) if trainer else None, sinks=mine,
                        max_inflight=2, keep=kept[rank])
            if mine is not None:
                via = torch.float32 if rnd == 3 else None
                bad = [k for k, v in expected(PLAN, rank, rnd, via=via).items()
                       if not same(mine[k], v)]
                assert not bad, (rank, rnd, bad)
        kept[rank].append(dict(t._spans))

    raise_first(await run_world("m2n", PLAN, body=body, bucket_bytes=1 << 20))
    for rank in (0, 1):
        assert [st.in_place_stacks for st in kept[rank][:-1]] == [1, 1, 1, 0], rank
        assert kept[rank][-1] == {}, rank  # nothing held over the bf16 buffer


async def test_a_stack_with_one_load_callback_is_scattered(fake_world: Any) -> None:
    got: dict[int, torch.Tensor] = {}
    held: dict[int, dict[str, Any]] = {}

    def sinks_of(rank: int) -> dict[str, Any]:
        if rank not in held:
            held[rank] = flat_views(targets(PLAN, rank), STACKED, fill=False)[1]
            held[rank]["e3"] = lambda name, t: got.__setitem__(rank, t.clone())
        return held[rank]

    kept: dict[int, list[Any]] = {}

    async def body(rank: int, t: Any) -> None:
        trainer = rank < PLAN.trainer_ranks
        kept[rank] = []
        for rnd in range(3):
            mine = None if trainer else sinks_of(rank)
            await drive(t, round=rnd, deadline=time.monotonic() + 30,
                        sources=sources(PLAN, rank, rnd) if trainer else None, sinks=mine,
                        max_inflight=2, keep=kept[rank])
            if mine is not None:
                want = expected(PLAN, rank, rnd)
                bad = [k for k, v in want.items() if k != "e3" and not same(mine[k], v)]
                assert not bad and same(got[rank], want["e3"]), (rank, rnd, bad)

    raise_first(await run_world("m2n", PLAN, body=body, bucket_bytes=1 << 20))
    assert all(st.in_place_stacks == 0 for st in kept[2] + kept[3])


async def test_tensors_the_lane_has_seen_stay_swappable(fake_world: Any) -> None:
    # Rounds 0-1: the same sources and targets (the stack's members back to back in one
    # buffer, the norms their own tensors), so after round 1 the lane reuses their
    # descriptors and skips the stack's full check. Before round 2 every one of them is swapped
    # with ``torch.utils.swap_tensors`` (what ``Module.to`` does under swap-on-conversion):
    # that refuses a tensor with a weak reference, or one that a view keeps as its base, so
    # the lane must hold neither. Rounds 2-3 follow the swapped tensors, bit-exact: each
    # member now has storage of its own, so the stack is packed and scattered. The members
    # are tensor objects of their own given the buffer's views through ``.data`` (as
    # Megatron's DDP does with its parameters), not views: a view of one of those has that
    # member as its base.
    src: dict[int, dict[str, torch.Tensor]] = {}
    dst: dict[int, dict[str, torch.Tensor]] = {}

    def swap_all(mine: dict[str, torch.Tensor]) -> None:
        for t in mine.values():
            torch.utils.swap_tensors(t, torch.zeros_like(t))

    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        fresh = sources(PLAN, rank, rnd)
        if rank not in src:
            src[rank] = own_objects(flat_views(fresh, STACKED)[1])
        elif rnd == 2:
            swap_all(src[rank])
        for n, v in src[rank].items():
            v.copy_(fresh[n])
        return src[rank]

    def dst_of(rank: int, rnd: int, last: Any) -> dict[str, torch.Tensor]:
        if rank not in dst:
            dst[rank] = own_objects(flat_views(targets(PLAN, rank), STACKED, fill=False)[1])
        elif rnd == 2:
            swap_all(dst[rank])
        return dst[rank]

    kept = await run(src_of, dst_of, rounds=4)
    for rank, stagings in kept.items():
        assert [st.in_place_stacks for st in stagings[:-1]] == [1, 1, 0, 0], rank
        assert all(st.zero_copy == 2 for st in stagings[:-1]), rank  # the norms, every round


async def test_storage_let_go_between_rounds_is_not_held(fake_world: Any) -> None:
    # Rounds 0-2 move the stack in place from (trainers) and into (workers) one flat buffer
    # per rank. Then every member gets storage of its own through ``.data`` and the flat
    # buffer is dropped (weights offloaded between rounds, the memory wanted for something
    # else): the lane must not hold it, not through a view over the stack nor through a
    # descriptor. Round 3 moves the members from and into their new storage.
    from torch.multiprocessing.reductions import StorageWeakRef

    mine: dict[int, dict[str, torch.Tensor]] = {}
    flat: dict[int, Any] = {}

    def let_go(rank: int) -> None:
        for n in STACKED:
            mine[rank][n].data = mine[rank][n].data.clone()
        gc.collect()
        assert flat[rank].expired(), f"rank {rank}: the flat buffer is still held"

    def src_of(rank: int, rnd: int) -> dict[str, torch.Tensor]:
        if rank not in mine:
            buf, views = flat_views(sources(PLAN, rank, rnd), STACKED)
            mine[rank], flat[rank] = own_objects(views), StorageWeakRef(buf.untyped_storage())
        elif rnd == 3:
            let_go(rank)
        for n, v in sources(PLAN, rank, rnd).items():
            mine[rank][n].copy_(v)
        return mine[rank]

    def dst_of(rank: int, rnd: int, last: Any) -> dict[str, torch.Tensor]:
        if rank not in mine:
            buf, views = flat_views(targets(PLAN, rank), STACKED, fill=False)
            mine[rank], flat[rank] = own_objects(views), StorageWeakRef(buf.untyped_storage())
        elif rnd == 3:
            let_go(rank)
        return mine[rank]

    kept = await run(src_of, dst_of, rounds=4)
    for rank, stagings in kept.items():
        assert [st.in_place_stacks for st in stagings[:-1]] == [1, 1, 1, 0], rank
