"""256 concurrent clients x 1,000 mixed operations: counters exact, no lost wakeups.

Every client runs rounds of: an atomic add on a shared counter, a set/get of its own key, a
compare-and-set increment on a key shared by eight clients (retried until it swaps), a
ring hand-off (set my key, block until both neighbours' keys of the round exist — a lost
wakeup hangs the ring and trips the deadline), and every few rounds a 256-way gather barrier.
The counts at the end must be exact. ``M2N_STORE_STRESS_OPS`` scales the operations per client.
"""

from __future__ import annotations

import os
import time

import anyio
import pytest
from store_helpers import World

from m2n_async import Store, StoreClient

pytestmark = pytest.mark.asyncio

CLIENTS = 256
OPS = int(os.environ.get("M2N_STORE_STRESS_OPS", "1000"))
OPS_PER_ROUND = 9  # add, set, get, cas get + cas, ring set + wait, add, delete (+ barriers)
ROUNDS = max(OPS // OPS_PER_ROUND, 2)
BARRIER_EVERY = 25
CAS_GROUP = 8
DEADLINE = float(os.environ.get("M2N_STORE_STRESS_DEADLINE", "240"))


async def client_loop(store: Store, i: int, cas_retries: list[int], ops: list[int]) -> None:
    left, right = (i - 1) % CLIENTS, (i + 1) % CLIENTS
    done = 0
    for r in range(ROUNDS):
        await store.add("s/counter", 1)
        mine = f"s/own/{i}"
        await store.set(mine, b"%d:%d" % (i, r))
        assert await store.get(mine) == b"%d:%d" % (i, r)
        cas_key = f"s/cas/{i // CAS_GROUP}"
        while True:
            current = await store.get(cas_key)
            new = b"%d" % (int(current or b"0") + 1)
            swapped, _ = await store.compare_set(cas_key, current, new)
            done += 2
            if swapped:
                break
            cas_retries[0] += 1
        await store.set(f"s/ring/{r}/{i}", b"")
        if r % 2:
            await store.get(f"s/ring/{r}/{left}", wait=True)
            await store.get(f"s/ring/{r}/{right}", wait=True)
        else:
            await store.wait([f"s/ring/{r}/{left}", f"s/ring/{r}/{right}"])
        done += 5
        if r >= 2:
            # Both neighbours have entered round r, so both have read my round r-2 key.
            await store.delete(f"s/ring/{r - 2}/{i}")
            done += 1
        if r % BARRIER_EVERY == BARRIER_EVERY - 1:
            await store.set(f"s/bar/{r}/{i}", b"")
            got = await store.gather(f"s/bar/{r}/", CLIENTS)
            assert len(got) == CLIENTS
            done += 2
        await store.add(f"s/mine/{i}", 1)
        done += 1
    ops.append(done)


async def run_world(sessions: list[Store], world_len: object) -> tuple[float, list[int], int]:
    retries = [0]
    ops: list[int] = []
    t0 = time.monotonic()
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for i, s in enumerate(sessions):
                tg.start_soon(client_loop, s, i, retries, ops)
    return time.monotonic() - t0, ops, retries[0]


async def check(store: Store, ops: list[int]) -> None:
    assert await store.get("s/counter") == b"%d" % (CLIENTS * ROUNDS)
    for g in range(CLIENTS // CAS_GROUP):
        assert await store.get(f"s/cas/{g}") == b"%d" % (CAS_GROUP * ROUNDS)
    for i in range(CLIENTS):
        assert await store.get(f"s/mine/{i}") == b"%d" % ROUNDS
    assert len(ops) == CLIENTS and min(ops) >= 8 * ROUNDS


@pytest.mark.slow
async def test_256_clients_mixed_ops(world: World) -> None:
    sessions = [await world.session() for _ in range(CLIENTS)]
    if world.kind == "tcp":
        assert all(isinstance(s, StoreClient) for s in sessions)  # 256 real connections
    seconds, ops, retries = await run_world(sessions, len)
    await check(sessions[0], ops)
    assert world.core.pending_waiters == 0
    print(f"\n{world.kind}: {CLIENTS} clients x {min(ops)}..{max(ops)} ops in {seconds:.1f} s "
          f"({sum(ops) / seconds:,.0f} ops/s; {retries} CAS retries)")

