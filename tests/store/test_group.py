"""ControlGroup over both Store implementations."""

from __future__ import annotations

import time

import anyio
import msgspec
import pytest
from store_helpers import World

from m2n_async import ControlGroup, PeerLostError, RemoteProtocolError, Store
from m2n_async._proto.errors import LocalProtocolError
from m2n_async._store._api import SupportsExchange

pytestmark = pytest.mark.asyncio

DEADLINE = 20.0


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    rank: int
    note: str


class Other(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    value: float


class PlainStore:
    """Only the Store protocol (no ``exchange``): exercises ControlGroup's fallback path."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.set, self.get, self.wait = inner.set, inner.get, inner.wait
        self.add, self.compare_set, self.delete = inner.add, inner.compare_set, inner.delete
        self.delete_prefix, self.gather = inner.delete_prefix, inner.gather
        self.aclose = inner.aclose


async def make_groups(world: World, n: int, namespace: str = "job/1/g", *,
                      plain: bool = False) -> list[ControlGroup]:
    stores: list[Store] = [await world.session() for _ in range(n)]
    if plain:
        stores = [PlainStore(s) for s in stores]  # type: ignore[misc]
        assert not isinstance(stores[0], SupportsExchange)
    groups = [ControlGroup(stores[r], r, n, namespace) for r in range(n)]
    for g in groups:
        await g.join()
    return groups


async def run_all(groups: list[ControlGroup], fn: object) -> dict[int, object]:
    out: dict[int, object] = {}

    async def one(g: ControlGroup) -> None:
        out[g.rank] = await fn(g)  # type: ignore[operator]

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for g in groups:
                tg.start_soon(one, g)
    return out


async def test_all_gather_typed(world: World) -> None:
    groups = await make_groups(world, 5)
    out = await run_all(groups, lambda g: g.all_gather(Hello(g.rank, f"r{g.rank}"), Hello))
    expected = [Hello(r, f"r{r}") for r in range(5)]
    assert out == {r: expected for r in range(5)}


async def test_all_gather_bytes_and_barrier(world: World) -> None:
    groups = await make_groups(world, 3)
    out = await run_all(groups, lambda g: g.all_gather_bytes(bytes([g.rank]) * 1000))
    assert out[2] == [bytes([r]) * 1000 for r in range(3)]
    out = await run_all(groups, lambda g: g.barrier())
    assert out == {0: None, 1: None, 2: None}


@pytest.mark.parametrize("root", [0, 2])
async def test_broadcast(world: World, root: int) -> None:
    groups = await make_groups(world, 3)
    out = await run_all(groups, lambda g: g.broadcast(
        Hello(root, "from root") if g.rank == root else None, Hello, root))
    assert out == {r: Hello(root, "from root") for r in range(3)}


async def test_broadcast_root_without_envelope_is_a_local_error(world: World) -> None:
    (g,) = await make_groups(world, 1)
    with pytest.raises(LocalProtocolError, match="root rank 0"):
        await g.broadcast(None, Hello, 0)
    with pytest.raises(ValueError, match="root"):
        await g.broadcast(None, Hello, 3)


async def test_wrong_envelope_type_names_the_rank(world: World) -> None:
    groups = await make_groups(world, 3)

    async def call(g: ControlGroup) -> object:
        envelope: object = Other(1.5) if g.rank == 1 else Hello(g.rank, "x")
        try:
            return await g.all_gather(envelope, Hello)
        except RemoteProtocolError as exc:
            return str(exc)

    out = await run_all(groups, call)
    assert all("rank 1" in str(v) and "invalid" in str(v) for v in out.values())


@pytest.mark.parametrize("plain", [False, True], ids=["exchange", "set+gather"])
async def test_no_key_growth_over_thousands_of_rounds(world: World, plain: bool) -> None:
    n, rounds = 4, 2000
    groups = await make_groups(world, n, plain=plain)
    sizes: list[int] = []

    async def loop(g: ControlGroup) -> None:
        for i in range(rounds):
            if i % 3 == 0:
                await g.barrier()
            elif i % 3 == 1:
                got = await g.all_gather_bytes(b"%d:%d" % (g.rank, i))
                assert got == [b"%d:%d" % (r, i) for r in range(n)]
            else:
                assert await g.broadcast(i if g.rank == 1 else None, int, 1) == i
            if g.rank == 0:
                sizes.append(len(world.core))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for g in groups:
                tg.start_soon(loop, g)
    # liveness keys + at most three calls' keys per rank (each keeps its last two; a rank
    # may be one call ahead of another).
    assert max(sizes) <= n + 3 * n
    assert len(world.core) <= 3 * n
    for g in groups:
        await g.aclose()
    assert len(world.core) == 0, world.core.keys()


async def _gather_or_record_loss(g: ControlGroup, errors: dict[int, PeerLostError]) -> None:
    """One all-gather on ``g``; a ``PeerLostError`` is recorded under ``g.rank``."""
    try:
        await g.all_gather_bytes(b"x")
    except PeerLostError as exc:
        errors[g.rank] = exc


async def test_peer_lost_names_the_rank_fast(world: World) -> None:
    groups = await make_groups(world, 4)
    errors: dict[int, PeerLostError] = {}
    t_fail: dict[int, float] = {}

    async def survivor(g: ControlGroup) -> None:
        await _gather_or_record_loss(g, errors)
        if g.rank in errors:
            t_fail[g.rank] = time.monotonic()

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for g in groups[:3]:
                tg.start_soon(survivor, g)
            await anyio.sleep(0.1)
            t0 = time.monotonic()
            await groups[3].store.aclose()  # rank 3 dies before contributing
    assert sorted(errors) == [0, 1, 2]
    for r, exc in errors.items():
        assert exc.ranks == (3,)
        assert "rank 3" in str(exc) and "job/1/g" in str(exc)
        assert t_fail[r] - t0 < 2.0


@pytest.mark.parametrize("plain", [False, True])
async def test_a_rank_that_contributed_then_left_is_not_lost(world: World, plain: bool) -> None:
    # Rank 0 contributes and its session ends (its own deadline fired first: it entered the
    # phase earlier). Rank 1 waits for rank 2, which is merely late: rank 1 must not blame
    # rank 0 — that diagnosis would differ from its peers' — and must complete when rank 2
    # arrives. The preflight once failed on exactly this race.
    groups = await make_groups(world, 3, plain=plain)
    got: dict[int, list[bytes]] = {}

    async def one(g: ControlGroup) -> None:
        got[g.rank] = await g.all_gather_bytes(bytes([g.rank]))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, groups[1])
            with anyio.move_on_after(0.2):
                await groups[0].all_gather_bytes(b"\x00")
            await groups[0].store.aclose()  # contributed, then the session ended
            await anyio.sleep(0.2)  # rank 1 has seen the loss and must still be waiting
            assert 1 not in got
            tg.start_soon(one, groups[2])
    assert got[1] == got[2] == [b"\x00", b"\x01", b"\x02"]


async def test_a_non_contributor_is_lost_even_after_a_contributor_left(world: World) -> None:
    groups = await make_groups(world, 4)
    errors: dict[int, PeerLostError] = {}

    async def survivor(g: ControlGroup) -> None:
        await _gather_or_record_loss(g, errors)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(survivor, groups[1])
            tg.start_soon(survivor, groups[2])
            with anyio.move_on_after(0.2):
                await groups[0].all_gather_bytes(b"x")
            await groups[0].store.aclose()  # contributed, then left: not lost
            await anyio.sleep(0.2)
            await groups[3].store.aclose()  # never contributed: lost
    assert sorted(errors) == [1, 2]
    assert all(e.ranks == (3,) for e in errors.values()), errors


async def test_missing_ranks_and_skipped_call_isolation(world: World) -> None:
    groups = await make_groups(world, 3)
    assert await groups[0].missing_ranks() == []
    await run_all(groups, lambda g: g.barrier())
    assert await groups[0].missing_ranks() == []  # the last call completed
    # Rank 2 skips a call: ranks 0 and 1 wait under call 1's prefix while rank 2's next call is
    # call 1 of a different kind — nobody reads another call's envelope; they time out.
    results: dict[int, object] = {}

    async def lagging(g: ControlGroup) -> None:
        with anyio.move_on_after(0.5):
            results[g.rank] = await g.all_gather_bytes(b"a")

    async def skipper(g: ControlGroup) -> None:
        with anyio.move_on_after(0.5):
            results[g.rank] = await g.broadcast(7, int, 2)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lagging, groups[0])
            tg.start_soon(lagging, groups[1])
            tg.start_soon(skipper, groups[2])
    assert results == {}
    assert await groups[0].missing_ranks() == [2]
    assert await groups[2].missing_ranks() == [0, 1]


async def test_group_validates_arguments(world: World) -> None:
    s = await world.session()
    with pytest.raises(ValueError, match="rank"):
        ControlGroup(s, 3, 3, "ns")
    with pytest.raises(ValueError, match="world_size"):
        ControlGroup(s, 0, 0, "ns")
    with pytest.raises(ValueError, match="namespace"):
        ControlGroup(s, 0, 1, "ns/")


class _GatedReads:
    """A store whose ``get`` of a call-0 key waits for ``gate`` (a slow rank, one round trip
    behind); it announces that it is waiting with ``entered``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.gate = anyio.Event()
        self.entered = anyio.Event()
        self.set, self.wait, self.add = inner.set, inner.wait, inner.add
        self.compare_set, self.delete = inner.compare_set, inner.delete
        self.delete_prefix, self.gather = inner.delete_prefix, inner.gather
        self.aclose = inner.aclose
        if isinstance(inner, SupportsExchange):
            self.exchange = inner.exchange

    async def get(self, key: str, **kwargs: object) -> bytes | None:
        if "/c/0/" in key:
            self.entered.set()
            await self.gate.wait()
        return await self.inner.get(key, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("plain", [False, True], ids=["exchange", "plain"])
async def test_slow_rank_finishes_a_call_past_a_departure_after_peers_moved_on(
        world: World, plain: bool) -> None:
    # Rank 2 contributes to call 0 and leaves; rank 0, told so, re-gathers call 0 one round
    # trip late. Meanwhile rank 1 finishes call 0 and starts call 1. Rank 1 must not delete
    # its call-0 key then (only call -1's), or rank 0's re-gather waits forever for it.
    groups = await make_groups(world, 3, plain=plain)
    slow = _GatedReads(groups[0].store)
    groups[0].store = slow  # type: ignore[assignment]
    outcome: dict[int, object] = {}

    async def rank0() -> None:
        await groups[0].barrier()
        outcome[0] = "ok"

    async def rank2_contributes() -> None:
        await groups[2].barrier()

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rank0)
            async with anyio.create_task_group() as leaving:
                leaving.start_soon(rank2_contributes)
                while "job/1/g/c/0/barrier/2" not in world.core.keys():  # noqa: ASYNC110 - server state
                    await anyio.sleep(0.001)
                leaving.cancel_scope.cancel()
            await groups[2].store.aclose()  # its liveness key vanishes
            await slow.entered.wait()  # rank 0 is past the loss, about to re-gather
            await groups[1].barrier()  # call 0 is complete for rank 1
            with pytest.raises(PeerLostError):
                await groups[1].barrier()  # call 1: rank 2 never comes
            slow.gate.set()
    assert outcome == {0: "ok"}


async def test_leaving_as_lost_keeps_the_contributions_and_tells_the_watchers(
        world: World) -> None:
    groups = await make_groups(world, 3)
    await run_all(groups, lambda g: g.barrier())
    await groups[2].aclose(lost=True)
    keys = world.core.keys()
    # A peer still in call 0 can see rank 2 contributed to it (drop_departed), so it does
    # not blame rank 2 for that call; a peer waiting on rank 2 hears it is gone.
    assert "job/1/g/c/0/barrier/2" in keys and "job/1/g/alive/2" not in keys
    with pytest.raises(PeerLostError) as info:
        await groups[0].store.get("job/1/g/never", wait=True,
                                  watch=[groups[0].alive_key(2)])
    assert info.value.key == groups[0].alive_key(2)


async def test_all_gather_open_takes_any_index_and_waits_until_settled(world: World) -> None:
    # Ranks 0 and 1 were given a world of 2, rank 2 one of 3: its key is beyond the others'
    # world, and none of them refuses it as foreign; each waits until it holds {0, 1, 2}.
    stores = [await world.session() for _ in range(3)]
    groups = [ControlGroup(stores[0], 0, 2, "job/1/g"), ControlGroup(stores[1], 1, 2, "job/1/g"),
              ControlGroup(stores[2], 2, 3, "job/1/g")]
    for g in groups:
        await g.join()
    seen: list[list[int]] = []

    def settled(view: object) -> bool:
        seen.append(sorted(view))  # type: ignore[call-overload]
        return sorted(view) == [0, 1, 2]  # type: ignore[call-overload]

    out = await run_all(groups, lambda g: g.all_gather_open(bytes([g.rank]), settled))
    assert out == {r: {0: b"\x00", 1: b"\x01", 2: b"\x02"} for r in range(3)}
    assert [0, 1, 2] in seen


async def test_the_first_decided_view_wakes_a_rank_waiting_for_keys_that_never_come(
        world: World) -> None:
    stores = [await world.session() for _ in range(2)]
    big = ControlGroup(stores[0], 0, 5, "job/1/g")  # waits for 5 keys; 2 will ever exist
    small = ControlGroup(stores[1], 1, 2, "job/1/g")
    for g in (big, small):
        await g.join()
    got: dict[int, bytes] = {}

    async def waiting() -> None:
        # Its first gather wants 5 keys: only the decision of a peer can end it.
        got.update(await big.all_gather_open(b"a", lambda view: len(view) == 5))

    with anyio.fail_after(DEADLINE / 4):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            mine = await small.all_gather_open(b"b", lambda view: len(view) == 2)
            started = time.monotonic()
    assert time.monotonic() - started < 1.0
    assert got == mine == {0: b"a", 1: b"b"}


async def test_every_rank_returns_the_first_recorded_view(world: World) -> None:
    # Rank 1's own rule never settles: it returns the view rank 0 recorded. So does a rank
    # that posts after the decision (its own key is not in the view), and a second call
    # of the same prefix.
    stores = [await world.session() for _ in range(3)]
    groups = [ControlGroup(stores[r], r, 2, "job/1/g") for r in range(2)]
    late = ControlGroup(stores[2], 2, 9, "job/1/g")  # a world of 9: 7 keys never come
    for g in (*groups, late):
        await g.join()

    def settled(view: object) -> bool:
        return {0, 1} <= set(view)  # type: ignore[call-overload]

    async with anyio.create_task_group() as tg:
        tg.start_soon(groups[1].all_gather_open, b"b", lambda view: False)  # waits
        first = await groups[0].all_gather_open(b"a", settled)
    assert first == {0: b"a", 1: b"b"}
    # Rank 1 posted again: a fresh group of the same namespace replays call 0.
    again = ControlGroup(stores[1], 1, 2, "job/1/g")
    with anyio.fail_after(DEADLINE / 4):
        second = await again.all_gather_open(b"b", settled)
        third = await late.all_gather_open(b"c", lambda view: len(view) == 9)
    assert second == third == first
