"""Replies stay matched to their requests under the engine's round pattern, with cancellation.

The engine's round, per rank and on one client: a watchdog ``get(abort, wait=True, watch=...)``
that is cancelled when the pipeline ends (the client sends ``Cancel(rid)``), then
``set(done/k)`` + ``gather(done/, n, watch=...)`` (or the atomic ``exchange``). Around it, more
tasks on the same client mix blocking gets (with ``watch``) that are cancelled at random points
with sets, adds, plain gets and gathers, while the other ranks' connections set the keys they
wait for. Every value encodes the key it was written under, so a reply handed to the wrong
request (or sent on the wrong connection) fails the check — and over TCP a reply of the wrong
type breaks the client, which fails the test too.
"""

from __future__ import annotations

import random

import anyio
import anyio.lowlevel
import pytest
from store_helpers import World

from m2n_async import PeerLostError, Store, SupportsExchange

pytestmark = pytest.mark.asyncio

RANKS = 4
ROUNDS = 12
CHATTER = 6  # extra tasks per rank
DEADLINE = 30.0


def val(key: str, tag: int) -> bytes:
    return f"{key}={tag}".encode()


def check_val(key: str, got: bytes | None) -> None:
    assert got is not None, f"get({key!r}) returned None"
    assert got.startswith(f"{key}=".encode()), f"get({key!r}) returned {got!r}"


async def chatter(store: Store, rank: int, c: int, k: int, alive: list[str],
                  rng: random.Random, stop: anyio.Event) -> None:
    """Mixed traffic on the rank's client while its round runs."""
    n = 0
    while not stop.is_set():
        n += 1
        mine = f"c/{k}/{rank}/{c}/{n}"
        await store.set(mine, val(mine, n))
        check_val(mine, await store.get(mine))
        assert await store.add(f"n/{k}/{rank}/{c}", 1) == n
        # A blocking get on a key another rank writes now or later (or never): cancelled at a
        # random point, or answered.
        other = f"c/{k}/{rng.randrange(RANKS)}/{rng.randrange(CHATTER)}/{n + rng.randrange(3)}"
        with anyio.move_on_after(rng.choice([0, 0, 0.0005, 0.002, 0.01])):
            check_val(other, await store.get(other, wait=True, watch=alive))
        got = await store.gather(f"c/{k}/{rank}/", 0)
        for key, value in got.items():
            check_val(key, value)
        await anyio.lowlevel.checkpoint()


async def watchdog(store: Store, abort: str, watch: list[str]) -> None:
    """The engine's watchdog: nobody writes the abort key, so only cancellation ends it."""
    got = await store.get(abort, wait=True, watch=watch)
    raise AssertionError(f"{abort!r} was never written, got {got!r}")


async def rank_main(store: Store, rank: int, seed: int, use_exchange: bool) -> None:
    rng = random.Random(seed * 100 + rank)
    alive = [f"alive/{r}" for r in range(RANKS)]
    await store.set(alive[rank], val(alive[rank], 0), ephemeral=True)
    watch = [a for r, a in enumerate(alive) if r != rank]
    for k in range(1, ROUNDS + 1):
        abort = f"r/{k}/abort"
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:

            tg.start_soon(watchdog, store, abort, watch)
            for c in range(CHATTER):
                tg.start_soon(chatter, store, rank, c, k, watch, rng, stop)
            await anyio.sleep(rng.choice([0, 0.001, 0.003]))  # "the pipeline"
            stop.set()
            tg.cancel_scope.cancel()  # cancels the watchdog and any chatter mid-call
        done = f"r/{k}/done/{rank}"
        if use_exchange:
            assert isinstance(store, SupportsExchange)
            prev = f"r/{k - 1}/done/{rank}" if k > 1 else None
            got = await store.exchange(done, val(done, k), f"r/{k}/done/", RANKS, watch=watch,
                                       delete=prev)
        else:
            await store.set(done, val(done, k))
            got = await store.gather(f"r/{k}/done/", RANKS, watch=watch)
        assert sorted(got) == [f"r/{k}/done/{r}" for r in range(RANKS)]
        for key, value in got.items():
            assert value == val(key, k), (key, value)


@pytest.mark.parametrize("use_exchange", [False, True])
async def test_round_pattern_replies_match_requests(world: World, use_exchange: bool) -> None:
    stores = [await world.session() for _ in range(RANKS)]
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for rank, store in enumerate(stores):
                tg.start_soon(rank_main, store, rank, 7, use_exchange)
    for store in stores:  # every client is still healthy
        await store.set("health", b"ok")
        assert await store.get("health") == b"ok"
    with anyio.fail_after(DEADLINE):
        while world.core.pending_waiters:  # noqa: ASYNC110 - every Cancel reaches the server
            await anyio.sleep(0.01)


async def test_lost_session_fails_other_sessions_watchers(world: World) -> None:
    """A session that ends while others' waiters watch its liveness key fails them at once."""
    a, b = await world.session(), await world.session()
    await a.set("alive/a", b"1", ephemeral=True)
    errors: list[BaseException] = []

    async def watcher() -> None:
        try:
            await b.gather("never/", 2, watch=["alive/a"])
        except PeerLostError as exc:
            errors.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher)
            await anyio.sleep(0.05)
            await a.aclose()
    assert len(errors) == 1
    assert errors[0].key == "alive/a"  # type: ignore[attr-defined]
