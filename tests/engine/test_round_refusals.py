"""A trainer whose ``sync_weights`` refuses its own weights before joining the round leaves
its peers in the round (it may call again with fixed weights). When no later call joins, the
round's deadline verdict names that rank with the refusal it left, on every rank, instead of
calling it frozen; a later call that does join completes the round.

Engines end to end, every rank a task of one event loop over a ``MemoryStore`` (real Gloo),
with a short round deadline so the verdict comes quickly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

from m2n_async import (
    EngineConfig,
    LocalProtocolError,
    PlanError,
    TrainerEngine,
    TransferError,
    WorkerEngine,
)
from m2n_async._engine import _faults
from m2n_async._engine._faults import Fault
from m2n_async.testing import MemoryStore

from ._plans import ParamDef, R, empty_targets, make_plan, source_shards

T, N = 2, 2
ROUND_TIMEOUT = 3.0
CFG = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=30,
                   round_timeout=ROUND_TIMEOUT, abort_grace=2, host="127.0.0.1")
DEFS: list[ParamDef] = [("w", (12, 6), torch.float32, (R, 0), (R, 1))]
PLAN = make_plan(DEFS, (T, 1), (1, N))
SPECS = [p.spec for p in PLAN.params]


async def _engines(store: MemoryStore) -> list[Any]:
    engines: list[Any] = [None] * (T + N)

    async def one(r: int) -> None:
        if r < T:
            engines[r] = await TrainerEngine.connect(
                store=store.session(), rank=r, trainer_ranks=T, world_size=T + N,
                params=SPECS, config=CFG)
        else:
            targets = {p.spec.name: (x, p.dst.placements) for (_, x), p in zip(
                empty_targets(PLAN, r).items(), PLAN.params, strict=True)}
            engines[r] = await WorkerEngine.connect(
                store=store.session(), rank=r, trainer_ranks=T, world_size=T + N,
                targets=targets, mesh_dims=(1, N), config=CFG)

    async with anyio.create_task_group() as tg:
        for r in range(T + N):
            tg.start_soon(one, r)
    return engines


async def _run_and_close(engines: list[Any], call: Callable[[int], Awaitable[None]],
                         ranks: range) -> None:
    """``call(r)`` for every rank of ``ranks`` at once, bounded (a hang fails the test), then
    every engine closed."""
    try:
        with anyio.fail_after(ROUND_TIMEOUT + 30):
            async with anyio.create_task_group() as tg:
                for r in ranks:
                    tg.start_soon(call, r)
    finally:
        for e in engines:
            await e.close()


def _wrong(rank: int) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(t.shape[0] + 1, *t.shape[1:])
            for n, t in source_shards(PLAN, rank, 1).items()}


@pytest.mark.asyncio
async def test_a_refused_trainer_that_does_not_call_again_is_named_with_its_refusal() -> None:
    store = MemoryStore()
    engines = await _engines(store)
    got: dict[int, BaseException] = {}

    async def call(r: int) -> None:
        try:
            if r < T:
                await engines[r].sync_weights(_wrong(r) if r == 1 else source_shards(PLAN, r, 1))
            else:
                await engines[r].receive()
        except Exception as exc:
            got[r] = exc

    await _run_and_close(engines, call, range(T + N))
    assert isinstance(got[1], PlanError), got
    peers = {r: got[r] for r in (0, 2, 3)}
    assert all(isinstance(e, TransferError) for e in peers.values()), peers
    assert len({str(e) for e in peers.values()}) == 1, peers
    err = peers[0]
    assert isinstance(err, TransferError)
    assert (err.rank, err.cause) == (1, "deadline"), err
    assert "its sync_weights call was refused (PlanError: " in str(err), err
    assert "frozen" not in str(err), err


@pytest.mark.asyncio
async def test_a_refused_trainer_that_calls_again_completes_the_round() -> None:
    # The round commits once the fixed call joins (which takes the note back).
    store = MemoryStore()
    engines = await _engines(store)
    results: dict[int, Any] = {}

    async def call(r: int) -> None:
        if r == 1:
            with pytest.raises(PlanError):
                await engines[1].sync_weights(_wrong(1))
            results[1] = await engines[1].sync_weights(source_shards(PLAN, 1, 1))
        elif r < T:
            results[r] = await engines[r].sync_weights(source_shards(PLAN, r, 1))
        else:
            results[r] = await engines[r].receive()

    await _run_and_close(engines, call, range(T + N))
    assert sorted(results) == [0, 1, 2, 3]
    assert all(getattr(res, "version", 1) == 1 for res in results.values()), results


@pytest.mark.asyncio
async def test_a_refused_trainer_that_joined_since_is_not_named_with_its_old_refusal() -> None:
    # Rank 1 refuses, then joins the round late and hangs in its part: its report comes a
    # second after its peers' verdict, so the verdict finds it missing. It did join: the
    # refusal is no reason any more, and the verdict must not say "no call of it joined".
    store = MemoryStore()
    engines = await _engines(store)
    got: dict[int, BaseException] = {}
    # Later than the report window (1 s) after the start, so its report misses the verdict;
    # earlier than that verdict (the deadline plus the window), so it joins the round.
    late = ROUND_TIMEOUT / 2 + 1.0

    async def call(r: int) -> None:
        try:
            if r == 1:
                with pytest.raises(PlanError):
                    await engines[1].sync_weights(_wrong(1))
                await anyio.sleep(late)
                await engines[1].sync_weights(source_shards(PLAN, 1, 1))
            elif r < T:
                await engines[r].sync_weights(source_shards(PLAN, r, 1))
            else:
                await engines[r].receive()
        except Exception as exc:
            got[r] = exc

    _faults.arm([Fault("round.start", "hang", rank=1, round=1)])
    try:
        with anyio.fail_after(2 * ROUND_TIMEOUT + 30):
            async with anyio.create_task_group() as tg:
                for r in range(T + N):
                    tg.start_soon(call, r)
    finally:
        _faults.disarm()
        for e in engines:
            await e.close()
    assert sorted(got) == [0, 1, 2, 3], got
    assert len({str(e) for e in got.values()}) == 1, got
    err = got[0]
    assert isinstance(err, TransferError) and (err.rank, err.cause) == (1, "deadline"), err
    assert "refused" not in str(err), err


@pytest.mark.asyncio
@pytest.mark.parametrize("refused", ["weights", "timeout"])
async def test_rank_0_refused_is_named_with_its_refusal_by_the_trainers_waiting(
        refused: str) -> None:
    # Its weights (a misshapen shard) or its arguments (a timeout that is no deadline).
    store = MemoryStore()
    engines = await _engines(store)
    got: dict[int, BaseException] = {}

    async def call(r: int) -> None:
        try:
            if r == 0 and refused == "timeout":
                await engines[0].sync_weights(source_shards(PLAN, 0, 1), timeout=-1)
            else:
                await engines[r].sync_weights(_wrong(0) if r == 0 else source_shards(PLAN, r,
                                                                                     1))
        except Exception as exc:
            got[r] = exc

    await _run_and_close(engines, call, range(T))
    kind = PlanError if refused == "weights" else LocalProtocolError
    assert type(got[0]) is kind, got
    err = got[1]
    assert isinstance(err, TransferError) and (err.rank, err.cause) == (0, "deadline"), err
    assert f"its sync_weights call was refused ({kind.__name__}: " in str(err), err


@pytest.mark.asyncio
async def test_a_call_cancelled_while_it_takes_its_refusal_back_is_a_cancel_in_the_round() -> None:
    # Rank 1 refused, round 1 is published, and its next call is cancelled while it empties
    # its refusal note (the step between its checks and its wait for the start): as a cancel
    # there, the start found means the cancel is one in the round, named at once on every
    # rank (it stayed READY, and its peers sat out the deadline under its old refusal).
    store = MemoryStore()
    engines = await _engines(store)
    with pytest.raises(PlanError):
        await engines[1].sync_weights(_wrong(1))
    got: dict[int, BaseException] = {}
    states: dict[int, str] = {}
    session = engines[1]._store
    scope = anyio.CancelScope()
    real_set = session.set

    async def set_(key: str, value: bytes, **kw: Any) -> None:
        if key.endswith("/round/1/refused/1"):
            scope.cancel()  # the caller cancels right here
        await real_set(key, value, **kw)

    async def call(r: int) -> None:
        try:
            if r == 1:
                await store.get(f"{engines[1]._namespace}/round/1/start", wait=True)
                session.set = set_
                with scope:
                    await engines[1].sync_weights(source_shards(PLAN, 1, 1))
                states[1] = engines[1].state.value
            elif r < T:
                await engines[r].sync_weights(source_shards(PLAN, r, 1))
            else:
                await engines[r].receive()
        except Exception as exc:
            got[r] = exc

    await _run_and_close(engines, call, range(T + N))
    assert scope.cancelled_caught and states == {1: "poisoned"}, (states, got)
    peers = {r: got[r] for r in (0, 2, 3)}
    assert all(isinstance(e, TransferError) for e in peers.values()), peers
    assert {(e.rank, e.cause) for e in peers.values()} == {(1, "cancelled")}, peers  # type: ignore[attr-defined]
