"""Job claims (``_store/_claims.py``): one live holder per (job, rank), in ticket order;
released by a clean release or by the holder's session ending; refused with the holder
named after the wait; ``rank_holder`` reads who holds a rank now."""

from __future__ import annotations

import os
from functools import partial

import anyio
import pytest

from m2n_async._store import JobClaimedError, claim_rank, next_generation, rank_holder
from m2n_async.testing import MemoryStore


@pytest.mark.asyncio
async def test_second_claimant_is_refused_naming_the_holder() -> None:
    store = MemoryStore()
    a, b = store.session(), store.session()
    held = await claim_rank(a, "job", 2, wait_s=1)
    await held.joined(4)
    with anyio.fail_after(5):
        with pytest.raises(JobClaimedError) as info:
            await claim_rank(b, "job", 2, wait_s=0.3)
    exc = info.value
    assert exc.job == "job" and exc.rank == 2 and exc.holder is not None
    assert exc.holder.pid == os.getpid() and exc.holder.generation == 4
    assert f"held by pid {os.getpid()}" in str(exc) and "generation 4" in str(exc)
    # The refused claimant left nothing behind; other ranks of the job are free.
    assert [k for k in store.core.keys() if k.startswith("job/claims/2/")] == [held.key]
    other = await claim_rank(b, "job", 3, wait_s=1)
    await other.release()


@pytest.mark.asyncio
async def test_a_waiting_claimant_takes_over_when_the_holder_goes() -> None:
    store = MemoryStore()
    a, b, c = store.session(), store.session(), store.session()
    await claim_rank(a, "job", 0, wait_s=1)
    got: list[str] = []

    async def wait_for(sess: MemoryStore, name: str) -> None:
        claim = await claim_rank(sess, "job", 0, wait_s=10)
        got.append(name)
        await claim.release()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for, b, "b")
            await anyio.sleep(0.2)  # b takes its ticket first
            tg.start_soon(wait_for, c, "c")
            await anyio.sleep(0.2)
            assert got == []
            await a.aclose()  # the holder's process died: its ephemeral claim went with it
    assert got == ["b", "c"]  # ticket order


@pytest.mark.asyncio
async def test_claims_survive_new_generations() -> None:
    store = MemoryStore()
    a = store.session()
    held = await claim_rank(a, "job", 1, wait_s=1)
    await next_generation(a, "job")
    await next_generation(a, "job")
    assert held.key in store.core.keys()
    with pytest.raises(JobClaimedError):
        await claim_rank(store.session(), "job", 1, wait_s=0.1)


@pytest.mark.asyncio
async def test_rank_holder_is_the_lowest_live_ticket_with_its_generation() -> None:
    store = MemoryStore()
    a, b = store.session(), store.session()
    assert await rank_holder(a, "job", 0) is None
    held = await claim_rank(a, "job", 0, wait_s=1)
    holder = await rank_holder(b, "job", 0)
    assert holder is not None and (holder.ticket, holder.generation) == (held.record.ticket, 0)
    await held.joined(3)
    holder = await rank_holder(b, "job", 0)
    assert holder is not None and holder.generation == 3
    assert await rank_holder(b, "job", 1) is None  # another rank of the job
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(claim_rank, b, "job", 0, wait_s=5))  # waits behind it
            await anyio.sleep(0.2)
            holder = await rank_holder(store, "job", 0)
            assert holder is not None and holder.generation == 3  # not the waiting one
            await a.aclose()  # the holder's process died: the waiting claimant holds now
    holder = await rank_holder(store, "job", 0)
    assert holder is not None and holder.ticket > held.record.ticket
    assert holder.generation == 0
