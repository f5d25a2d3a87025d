"""The Store conformance suite: every test runs against MemoryStore and the TCP store."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest
from store_helpers import World, errors_while

from m2n_async import (
    PeerLostError,
    StaleGenerationError,
    Store,
    StoreError,
    current_generation,
    generation_namespace,
    next_generation,
)
from m2n_async._store._api import SupportsExchange
from m2n_async._store._core import generation_key

pytestmark = pytest.mark.asyncio

DEADLINE = 10.0  # generous: a busy 2-core CI box; tests that measure speed say so explicitly


async def settle() -> None:
    """Let a blocking request reach the store (a few loop turns; TCP needs a round trip)."""
    await anyio.sleep(0.05)


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll store state owned by other tasks (the server's) until ``predicate`` holds."""
    with anyio.fail_after(DEADLINE):
        while not predicate():  # noqa: ASYNC110 - no event to wait on: it is foreign state
            await anyio.sleep(0.005)
    assert predicate(), what


# --- plain operations ------------------------------------------------------------------------


async def test_set_get_roundtrip(world: World) -> None:
    a, b = await world.session(), await world.session()
    assert isinstance(a, Store) and isinstance(a, SupportsExchange)  # structural protocols
    assert await a.get("k") is None
    await a.set("k", b"\x00\xffvalue")
    assert await b.get("k") == b"\x00\xffvalue"
    await b.set("k", b"")
    assert await a.get("k") == b""  # empty value is a value, not absence


async def test_add_is_int64_ascii(world: World) -> None:
    s = await world.session()
    assert await s.add("n") == 1
    assert await s.add("n", 41) == 42
    assert await s.add("n", -50) == -8
    assert await s.get("n") == b"-8"
    await s.set("text", b"abc")
    with pytest.raises(StoreError, match="non-integer"):
        await s.add("text")
    await s.set("big", str(2**63 - 1).encode())
    with pytest.raises(StoreError, match="overflows int64"):
        await s.add("big")
    assert await s.get("big") == str(2**63 - 1).encode()


async def test_compare_set(world: World) -> None:
    s = await world.session()
    assert await s.compare_set("c", None, b"one") == (True, b"one")
    assert await s.compare_set("c", None, b"two") == (False, b"one")
    assert await s.compare_set("c", b"nope", b"two") == (False, b"one")
    assert await s.compare_set("c", b"one", b"two") == (True, b"two")
    assert await s.get("c") == b"two"


async def test_delete_and_delete_prefix(world: World) -> None:
    s = await world.session()
    for k in ("p/a", "p/b", "p/c/d", "q/a"):
        await s.set(k, b"x")
    assert await s.delete("p/a") is True
    assert await s.delete("p/a") is False
    assert await s.delete_prefix("p/") == 2
    assert await s.get("p/b") is None
    assert await s.get("q/a") == b"x"
    assert await s.delete_prefix("nothing/") == 0


# --- blocking operations ---------------------------------------------------------------------


async def test_get_wait_wakes_on_set(world: World) -> None:
    a, b = await world.session(), await world.session()
    got: list[bytes | None] = []

    async def waiter() -> None:
        got.append(await a.get("late", wait=True))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await settle()
            assert got == []
            await b.set("late", b"v")
    assert got == [b"v"]
    assert world.core.pending_waiters == 0


async def test_get_wait_returns_existing_at_once(world: World) -> None:
    s = await world.session()
    await s.set("k", b"v")
    with anyio.fail_after(DEADLINE):
        assert await s.get("k", wait=True) == b"v"


async def test_wait_all_keys(world: World) -> None:
    a, b = await world.session(), await world.session()
    done = anyio.Event()

    async def waiter() -> None:
        await a.wait(["w/1", "w/2", "w/3"])
        done.set()

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await b.set("w/1", b"")
            await b.set("w/3", b"")
            await settle()
            assert not done.is_set()
            await b.set("w/2", b"")
    assert done.is_set()
    with anyio.fail_after(DEADLINE):
        await a.wait([])  # nothing to wait for


async def test_gather_waits_for_n_and_returns_all(world: World) -> None:
    sessions = [await world.session() for _ in range(4)]
    results: dict[int, dict[str, bytes]] = {}

    async def rank(r: int) -> None:
        await sessions[r].set(f"g/{r}", str(r).encode())
        results[r] = await sessions[r].gather("g/", 4)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for r in range(4):
                tg.start_soon(rank, r)
    expected = {f"g/{r}": str(r).encode() for r in range(4)}
    assert results == {r: expected for r in range(4)}
    assert list(results[0]) == sorted(expected)  # sorted by key


async def test_gather_zero_lists_without_waiting(world: World) -> None:
    s = await world.session()
    with anyio.fail_after(DEADLINE):
        assert await s.gather("none/", 0) == {}
        await s.set("some/x", b"1")
        assert await s.gather("some/", 0) == {"some/x": b"1"}
        assert await s.gather("some/", 1) == {"some/x": b"1"}


async def test_gather_ignores_keys_outside_prefix(world: World) -> None:
    a, b = await world.session(), await world.session()
    out: list[dict[str, bytes]] = []

    async def waiter() -> None:
        out.append(await a.gather("pre/", 2))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await b.set("pre", b"no")
            await b.set("prefix/x", b"no")
            await b.set("pre/1", b"1")
            await settle()
            assert out == []
            await b.set("pre/2", b"2")
    assert out == [{"pre/1": b"1", "pre/2": b"2"}]


async def test_gather_counts_deletes(world: World) -> None:
    a, b = await world.session(), await world.session()
    out: list[dict[str, bytes]] = []

    async def waiter() -> None:
        out.append(await a.gather("d/", 2))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            await b.set("d/1", b"1")
            tg.start_soon(waiter)
            await settle()
            await b.delete("d/1")
            await b.set("d/2", b"2")
            await settle()
            assert out == []  # one key present, not two
            await b.set("d/3", b"3")
    assert out == [{"d/2": b"2", "d/3": b"3"}]


@pytest.mark.parametrize("op", ["get", "wait", "gather"])
async def test_cancelled_wait_is_withdrawn_and_session_stays_usable(world: World, op: str
                                                                    ) -> None:
    a, b = await world.session(), await world.session()
    with anyio.move_on_after(0.2) as scope:
        if op == "get":
            await a.get("never", wait=True)
        elif op == "wait":
            await a.wait(["never"])
        else:
            await a.gather("never/", 1)
    assert scope.cancelled_caught
    await until(lambda: world.core.pending_waiters == 0, "waiter withdrawn")
    # The key now appears: nothing may be delivered to a later call by mistake.
    await b.set("never", b"late")
    await b.set("never/1", b"late")
    await a.set("mine", b"fresh")
    assert await a.get("mine") == b"fresh"
    assert await a.add("cnt") == 1
    with anyio.fail_after(DEADLINE):
        assert await a.get("never", wait=True) == b"late"


async def test_many_concurrent_waiters_on_one_session(world: World) -> None:
    a, b = await world.session(), await world.session()
    got: dict[int, bytes | None] = {}

    async def waiter(i: int) -> None:
        got[i] = await a.get(f"many/{i}", wait=True)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(waiter, i)
            await settle()
            for i in reversed(range(50)):
                await b.set(f"many/{i}", str(i).encode())
    assert got == {i: str(i).encode() for i in range(50)}


# --- liveness --------------------------------------------------------------------------------


async def test_ephemeral_keys_vanish_with_session(world: World) -> None:
    a, b = await world.session(), await world.session()
    await a.set("eph", b"1", ephemeral=True)
    await a.set("durable", b"1")
    assert await b.get("eph") == b"1"
    await a.aclose()
    await until(lambda: "eph" not in world.core.keys(), "ephemeral key removed")
    assert await b.get("eph") is None
    assert await b.get("durable") == b"1"


async def test_watch_raises_peer_lost_promptly_during_wait(world: World) -> None:
    a, b = await world.session(), await world.session()
    await b.set("alive/b", b"", ephemeral=True)
    caught: list[PeerLostError] = []
    lost_at: list[float] = []

    async def waiter() -> None:
        try:
            await a.get("result", wait=True, watch=["alive/b", "alive/never-existed"])
        except PeerLostError as exc:
            caught.append(exc)
            lost_at.append(time.monotonic())

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await settle()
            t0 = time.monotonic()
            await b.aclose()
    assert len(caught) == 1 and caught[0].key == "alive/b"
    assert lost_at[0] - t0 < 2.0  # pushed, not polled (typically ~1 ms)
    assert world.core.pending_waiters == 0


@pytest.mark.parametrize("op", ["get", "wait", "gather"])
async def test_watch_of_already_lost_key_fails_at_once(world: World, op: str) -> None:
    a, b = await world.session(), await world.session()
    await b.set("alive/b", b"", ephemeral=True)
    await b.aclose()
    await until(lambda: world.core.tombstones > 0, "tombstone recorded")
    with anyio.fail_after(DEADLINE), pytest.raises(PeerLostError) as info:
        if op == "get":
            await a.get("x", wait=True, watch=["alive/b"])
        elif op == "wait":
            await a.wait(["x"], watch=["alive/b"])
        else:
            await a.gather("x/", 1, watch=["alive/b"])
    assert info.value.key == "alive/b"


async def test_satisfied_wait_succeeds_despite_lost_watch(world: World) -> None:
    a, b = await world.session(), await world.session()
    await b.set("alive/b", b"", ephemeral=True)
    await b.set("data/b", b"payload")
    await b.aclose()
    await until(lambda: world.core.tombstones > 0, "tombstone recorded")
    with anyio.fail_after(DEADLINE):
        assert await a.gather("data/", 1, watch=["alive/b"]) == {"data/b": b"payload"}
        assert await a.get("data/b", wait=True, watch=["alive/b"]) == b"payload"


async def test_watched_key_that_never_existed_does_not_fail(world: World) -> None:
    a, b = await world.session(), await world.session()
    out: list[bytes | None] = []

    async def waiter() -> None:
        out.append(await a.get("k", wait=True, watch=["alive/ghost"]))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await settle()
            await b.set("k", b"v")
    assert out == [b"v"]


async def test_set_clears_tombstone(world: World) -> None:
    a, b = await world.session(), await world.session()
    await b.set("alive/b", b"", ephemeral=True)
    await b.aclose()
    await until(lambda: world.core.tombstones > 0, "tombstone recorded")
    c = await world.session()
    await c.set("alive/b", b"", ephemeral=True)  # the peer is back
    out: list[bytes | None] = []

    async def waiter() -> None:
        out.append(await a.get("k", wait=True, watch=["alive/b"]))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await settle()
            await c.set("k", b"ok")
    assert out == [b"ok"]


async def test_clean_delete_of_ephemeral_key_is_not_a_loss(world: World) -> None:
    a, b = await world.session(), await world.session()
    await b.set("alive/b", b"", ephemeral=True)
    await b.delete("alive/b")
    await b.aclose()
    await a.set("k", b"v")
    with anyio.fail_after(DEADLINE):
        assert await a.get("k", wait=True, watch=["alive/b"]) == b"v"
    assert world.core.tombstones == 0


async def test_ephemeral_ownership_moves_with_overwrite(world: World) -> None:
    a, b, c = await world.session(), await world.session(), await world.session()
    await a.set("e", b"a", ephemeral=True)
    await b.set("e", b"b", ephemeral=True)  # b owns it now
    await a.aclose()
    await anyio.sleep(0.05)
    assert await c.get("e") == b"b"
    await c.set("e", b"c")  # durable now
    await b.aclose()
    await anyio.sleep(0.05)
    assert await c.get("e") == b"c"


@pytest.mark.parametrize("op", ["compare_set", "add"])
async def test_ephemeral_ownership_moves_with_compare_set_and_add(world: World, op: str
                                                                  ) -> None:
    # Another session's write by compare-and-set (taking over a dead leader's key) or add is
    # its value now, durable as after its plain set: the first owner's end must not delete
    # it; the owner's own compare_set keeps its key ephemeral.
    a, b, c = await world.session(), await world.session(), await world.session()
    await a.set("e", b"1", ephemeral=True)
    if op == "compare_set":
        assert await b.compare_set("e", b"1", b"2") == (True, b"2")
    else:
        assert await b.add("e", 1) == 2
    await a.aclose()
    await anyio.sleep(0.05)
    assert await c.get("e") == b"2"
    await b.set("own", b"1", ephemeral=True)
    assert await b.compare_set("own", b"1", b"2") == (True, b"2")
    await b.aclose()
    await anyio.sleep(0.05)
    assert await c.get("own") is None  # still b's ephemeral key: gone with b


async def test_closed_session_refuses_calls(world: World) -> None:
    a = await world.session()
    await a.aclose()
    await a.aclose()  # idempotent
    with pytest.raises(StoreError):
        await a.get("k")


async def test_closing_a_session_fails_its_blocking_calls(world: World) -> None:
    # A task still waiting on a session that another task closes must not hang until its own
    # deadline: the call fails with StoreError at once (the TCP client fails every pending
    # call on close; the in-memory double used to forget them).
    a = await world.session()
    t0 = 0.0

    async def close() -> None:
        nonlocal t0
        t0 = time.monotonic()
        await a.aclose()

    errors = await errors_while(lambda: a.get("never", wait=True), close, StoreError,
                                deadline=DEADLINE)
    assert len(errors) == 1 and "closed" in str(errors[0]), errors
    assert time.monotonic() - t0 < 2.0


# --- generations -----------------------------------------------------------------------------


async def test_next_generation_and_stale_refusal(world: World) -> None:
    s, old_rank = await world.session(), await world.session()
    assert await current_generation(s, "job") == 0
    g1 = await next_generation(s, "job")
    assert g1 == 1 and await current_generation(s, "job") == 1
    ns1 = generation_namespace("job", g1, "preflight")
    assert ns1 == "job/1/preflight"
    await old_rank.set(f"{ns1}/x", b"old")
    await s.set("job/1", b"generation-level key")
    await s.set("otherjob/1/x", b"untouched")
    g2 = await next_generation(s, "job")
    assert g2 == 2
    # Older generation purged and refused, for reads and writes alike.
    assert f"{ns1}/x" not in world.core.keys() and "job/1" not in world.core.keys()
    with pytest.raises(StaleGenerationError) as info:
        await old_rank.set(f"{ns1}/x", b"late write")
    assert (info.value.job, info.value.generation, info.value.current) == ("job", 1, 2)
    assert "stale" in str(info.value) and "job" in str(info.value)
    with pytest.raises(StaleGenerationError):
        await old_rank.get(f"{ns1}/x")
    with pytest.raises(StaleGenerationError):
        await old_rank.delete_prefix("job/1/")
    with pytest.raises(StaleGenerationError):
        await old_rank.gather("job/1/", 1)
    # An unclosed prefix counts as its generation: "job/1" would also reach job/10/...
    for _ in range(8):
        await next_generation(s, "job")  # generation 10: its keys also start with "job/1"
    await s.set("job/10/live", b"state of generation 10")
    with pytest.raises(StaleGenerationError):
        await old_rank.gather(ns1.rsplit("/", 1)[0], 1)  # "job/1", the generation namespace
    with pytest.raises(StaleGenerationError):
        await old_rank.delete_prefix("job/1")
    assert await s.get("job/10/live") == b"state of generation 10"
    assert await s.gather("job/10", 1) == {"job/10/live": b"state of generation 10"}
    # The current generation, other jobs and non-generation keys work.
    await s.set("job/10/x", b"new")
    assert await s.get("job/10/x") == b"new"
    assert await s.get("otherjob/1/x") == b"untouched"
    assert await s.get("job/10x/y") is None  # not a generation segment
    assert world.core.keys().count("job/generation") == 1


async def test_waiters_on_stale_generation_fail(world: World) -> None:
    s, old_rank = await world.session(), await world.session()
    await next_generation(s, "j")
    caught = await errors_while(lambda: old_rank.gather("j/1/phase/", 4),
                                lambda: next_generation(s, "j"), StaleGenerationError,
                                deadline=DEADLINE)
    assert len(caught) == 1
    assert world.core.pending_waiters == 0


async def test_generation_key_validation() -> None:
    with pytest.raises(ValueError):
        generation_key("a/b")
    with pytest.raises(ValueError):
        generation_namespace("job", 1, "a/b")


# --- exchange (the atomic set + delete + gather extension) -----------------------------------


async def test_exchange_sets_deletes_and_gathers_atomically(world: World) -> None:
    a, b = await world.session(), await world.session()
    assert isinstance(a, SupportsExchange)
    await a.set("x/old", b"stale")
    out: list[dict[str, bytes]] = []

    async def first() -> None:
        out.append(await a.exchange("x/a", b"A", "x/", 2, delete="x/old"))  # type: ignore[attr-defined]

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await settle()
            assert await b.get("x/old") is None and await b.get("x/a") == b"A"
            assert out == []  # x/old was deleted before counting: one key, not two
            got = await b.exchange("x/b", b"B", "x/", 2)  # type: ignore[attr-defined]
    assert got == {"x/a": b"A", "x/b": b"B"}
    assert out == [got]


async def test_cancelled_exchange_keeps_the_set_and_withdraws_the_gather(world: World) -> None:
    a = await world.session()
    with anyio.move_on_after(0.2):
        await a.exchange("y/a", b"A", "y/", 5)  # type: ignore[attr-defined]
    await until(lambda: world.core.pending_waiters == 0, "gather withdrawn")
    assert await a.get("y/a") == b"A"


async def test_exchange_watch_reports_lost_peer(world: World) -> None:
    a, b = await world.session(), await world.session()
    await b.set("alive/b", b"", ephemeral=True)
    caught: list[PeerLostError] = []

    async def waiter() -> None:
        try:
            await a.exchange("z/a", b"A", "z/", 2, watch=["alive/b"])  # type: ignore[attr-defined]
        except PeerLostError as exc:
            caught.append(exc)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await settle()
            await b.aclose()
    assert [e.key for e in caught] == ["alive/b"]


async def test_delete_as_lost_fails_watchers_and_a_plain_delete_does_not(world: World) -> None:
    owner, peer = await world.session(), await world.session()
    await owner.set("j/1/alive/0", b"0", ephemeral=True)
    await owner.set("j/1/alive/1", b"1", ephemeral=True)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_wait_for_ever_watching, peer, "j/1/alive/0")
            while world.core.pending_waiters < 1:  # noqa: ASYNC110 - server-side state
                await anyio.sleep(0.01)
            assert await owner.delete("j/1/alive/0")  # a clean leave: the watcher waits on
            await settle()
            assert world.core.pending_waiters == 1
            tg.cancel_scope.cancel()
    caught = await errors_while(lambda: peer.get("j/1/never", wait=True,
                                                 watch=["j/1/alive/1"]),
                                lambda: owner.delete("j/1/alive/1", lost=True),
                                PeerLostError, deadline=DEADLINE)
    assert len(caught) == 1 and caught[0].key == "j/1/alive/1"
    with pytest.raises(PeerLostError):  # a tombstone: later watchers fail at once too
        await peer.get("j/1/never", wait=True, watch=["j/1/alive/1"])
    assert world.core.pending_waiters == 0


async def _wait_for_ever_watching(store: Store, key: str) -> None:
    await store.get("j/1/never", wait=True, watch=[key])


async def test_a_waiter_watching_several_lost_keys_hears_of_the_first_loss(
        world: World) -> None:
    first, second, peer = await world.session(), await world.session(), await world.session()
    await first.set("j/1/alive/0", b"0", ephemeral=True)
    await second.set("j/1/alive/1", b"1", ephemeral=True)
    await first.delete("j/1/alive/0", lost=True)  # lost first: the root cause
    await second.delete("j/1/alive/1", lost=True)
    with pytest.raises(PeerLostError) as info:
        await peer.get("j/1/never", wait=True, watch=["j/1/alive/1", "j/1/alive/0"])
    assert info.value.key == "j/1/alive/0"
