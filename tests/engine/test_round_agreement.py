"""Every rank ends a round alike, also where a record and the reports race: a rank that
closes after reporting ok while a peer's ok report is still in flight, a rank closed while
its ``receive`` waits for the round to start, and a rank whose ok report lands after a peer
fenced it late. Every rank is a task of one event loop over a ``MemoryStore`` (real Gloo);
the store session of one rank is slowed where the race needs it."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from m2n_async import EngineConfig, LocalProtocolError, TransferError
from m2n_async._proto.round import RoundKeys
from m2n_async.testing import MemoryStore

from ._plans import make_plan, source_shards
from .test_engine_local import DEFS, _close, _connect_all

pytestmark = pytest.mark.asyncio

PLAN_1_2 = make_plan(DEFS[:1], (1, 1), (1, 2))


def _slow_report(engine: Any, round_: int, seconds: float) -> anyio.Event:
    """Delay ``engine``'s own done report of round ``round_`` by ``seconds`` (a loaded store,
    or a rank frozen between its part and its report); the event is set when it starts."""
    session = engine._store
    real = session.compare_set
    started = anyio.Event()

    async def slow(key: str, expected: Any, desired: bytes) -> Any:
        if key.endswith(f"/round/{round_}/done/{engine.rank}"):
            started.set()
            await anyio.sleep(seconds)
        return await real(key, expected, desired)

    session.compare_set = slow
    return started


async def _guard(res: dict[int, Any], rank: int, fn: Any) -> None:
    try:
        res[rank] = await fn()
    except Exception as exc:
        res[rank] = exc


async def _one_round(plan: Any, trainers: Any, workers: Any) -> dict[int, Any]:
    """Round 1 of ``plan`` (one trainer): each rank's result or exception, by rank."""
    res: dict[int, Any] = {}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_guard, res, 0,
                          lambda: trainers[0].sync_weights(source_shards(plan, 0, 1)))
            for w in workers:
                tg.start_soon(_guard, res, w.rank, w.receive)
    return res


def _outcome(v: Any) -> tuple[Any, ...]:
    if isinstance(v, Exception):
        return (type(v).__name__, getattr(v, "rank", None), getattr(v, "cause", None))
    return ("ok", v.version)


async def test_a_close_after_reporting_ok_does_not_split_the_round() -> None:
    # Worker 1 reports ok, then its caller closes it (posting "left"), while worker 2's ok
    # report is still on its way: commit everywhere or fail everywhere, never both.
    store = MemoryStore()
    trainers, workers = await _connect_all(store, PLAN_1_2)
    engines = [*trainers, *workers]
    in_flight = _slow_report(workers[1], 1, 1.0)
    res: dict[int, Any] = {}
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_guard, res, 0,
                              lambda: trainers[0].sync_weights(source_shards(PLAN_1_2, 0, 1)))
                for w in workers:
                    tg.start_soon(_guard, res, w.rank, w.receive)
                await in_flight.wait()
                keys = RoundKeys(workers[0]._namespace, 1)
                await store.get(keys.done(1), wait=True)  # worker 1 reported ok
                await store.get(keys.done(0), wait=True)  # so did the trainer
                await workers[0].close()
        outcomes = {r: _outcome(v) for r, v in res.items()}
        assert outcomes[0] == outcomes[2], outcomes
        assert trainers[0].version == workers[1].version, outcomes
        if outcomes[0][0] != "ok":
            assert outcomes[0] == ("TransferError", 1, "left"), outcomes
    finally:
        await _close(*engines)


async def test_a_close_while_receive_waits_for_the_start_names_the_closed_rank() -> None:
    trainers, workers = await _connect_all(MemoryStore(), PLAN_1_2)
    res: dict[int, Any] = {}
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_guard, res, 2, workers[1].receive)
                await anyio.sleep(0.3)
                await workers[1].close()  # its receive still waits for round 1 to start
                tg.start_soon(_guard, res, 1, workers[0].receive)
                await anyio.sleep(0.1)
                await _guard(res, 0,
                             lambda: trainers[0].sync_weights(source_shards(PLAN_1_2, 0, 1)))
        # The closed rank's own wait ends with its close (it is no part of the round); the
        # round it left fails alike on the others, naming it.
        closed = res.pop(2)
        assert isinstance(closed, LocalProtocolError), closed
        assert "the engine was closed while waiting for round 1" in str(closed)
        assert all(isinstance(v, TransferError) for v in res.values()), res
        assert {_outcome(v) for v in res.values()} == {("TransferError", 2, "left")}, res
        assert len({str(v) for v in res.values()}) == 1, res
        assert workers[1].state.value == "closed"  # CLOSED stays CLOSED
    finally:
        await _close(*trainers, *workers)


async def test_a_rank_fenced_late_raises_the_verdicts_text() -> None:
    # The worker's ok report lands 2.5 s after its part, past the 1 s round deadline: the
    # trainer fences it late and posts the verdict; the worker must raise that same text.
    cfg = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=20,
                       round_timeout=1.0, abort_grace=3, host="127.0.0.1")
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan, cfg)
    _slow_report(workers[0], 1, 2.5)
    try:
        res = await _one_round(plan, trainers, workers)
        assert all(isinstance(v, TransferError) for v in res.values()), res
        assert {_outcome(v) for v in res.values()} == {("TransferError", 1, "deadline")}
        assert str(res[0]) == str(res[1]), res
    finally:
        await _close(*trainers, *workers)


def _late_reply(engine: Any, round_: int, seconds: float) -> None:
    """``engine``'s own done report of round ``round_`` lands at once, its reply ``seconds``
    later (a slow store or network, or the rank paused just after sending)."""
    session = engine._store
    real = session.compare_set

    async def late(key: str, expected: Any, desired: bytes) -> Any:
        got = await real(key, expected, desired)
        if key.endswith(f"/round/{round_}/done/{engine.rank}"):
            await anyio.sleep(seconds)
        return got

    session.compare_set = late


@pytest.mark.parametrize("rank", [0, 2])
async def test_a_report_whose_reply_comes_late_commits_with_its_peers(rank: int) -> None:
    # The report is on the store, its reply 1.5 s late, past abort_grace (1 s) but well
    # within the round: the peers commit on it, so must the rank that wrote it (it took
    # the late reply for a lost store and was POISONED, a round split).
    cfg = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=20,
                       round_timeout=8.0, abort_grace=1.0, host="127.0.0.1")
    trainers, workers = await _connect_all(MemoryStore(), PLAN_1_2, cfg)
    engines = [*trainers, *workers]
    _late_reply(engines[rank], 1, 1.5)
    try:
        res = await _one_round(PLAN_1_2, trainers, workers)
        assert {r: _outcome(v) for r, v in res.items()} == {r: ("ok", 1) for r in range(3)}
        assert all(e.version == 1 and e.state.value == "ready" for e in engines)
    finally:
        await _close(*engines)
