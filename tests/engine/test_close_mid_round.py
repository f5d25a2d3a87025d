"""``close()`` while this engine's round is still in progress, on a ``MemoryStore``.

Two orders: the closing rank's peers are still in the round (the round must fail on every
rank naming the closer, not a bystander whose transfer then breaks), and every rank already
reported ok while the closer still gathered the reports (the round commits, yet the closed
engine stays CLOSED).

And trainer rank 0's ``close()`` while its ``sync_weights`` is about to publish the round:
both write the round's start key, and whichever lands first is what every rank reads. The
closing start first: the round happens on no rank (rank 0's ``sync_weights`` raises, every
other rank sees the job end, also one that asks for the round later). The round's start
first: ``close()`` fails that round on every rank, naming rank 0, before it returns.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from m2n_async import EngineConfig, PeerLostError, TrainerEngine, TransferError, WorkerEngine
from m2n_async._engine import _faults
from m2n_async._engine._faults import Fault
from m2n_async._proto.messages import Abort, RoundStart, decode_as
from m2n_async._proto.plan import TransferPlan
from m2n_async.testing import MemoryStore

from ._plans import R, empty_targets, make_plan, source_shards

pytestmark = pytest.mark.asyncio

CFG = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=20,
                   round_timeout=20, abort_grace=2, host="127.0.0.1")
PLAN = make_plan([("w", (12, 6), torch.float32, (R, 0), (R, 1))], (1, 1), (1, 1))


#: One trainer, two workers: one waiting for the round, one asking for it later.
PLAN3 = make_plan([("w", (12, 6), torch.float32, (R, 0), (R, 1))], (1, 1), (1, 2))


async def connect_world(store: MemoryStore, session0: Any = None, plan: TransferPlan = PLAN
                        ) -> tuple[TrainerEngine, list[WorkerEngine]]:
    specs = [p.spec for p in plan.params]
    out: dict[int, Any] = {}

    async def trainer() -> None:
        out[0] = await TrainerEngine.connect(store=session0 or store.session(), rank=0,
                                             trainer_ranks=1, world_size=plan.world_size,
                                             params=specs, config=CFG)

    async def worker(r: int) -> None:
        targets = {p.spec.name: (t, p.dst.placements) for (_, t), p in
                   zip(empty_targets(plan, r).items(), plan.params, strict=True)}
        out[r] = await WorkerEngine.connect(store=store.session(), rank=r, trainer_ranks=1,
                                            world_size=plan.world_size, targets=targets,
                                            mesh_dims=plan.params[0].dst.mesh.dims,
                                            config=CFG)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            for r in range(1, plan.world_size):
                tg.start_soon(worker, r)
    return out[0], [out[r] for r in range(1, plan.world_size)]


async def connect(store: MemoryStore, session0: Any = None
                  ) -> tuple[TrainerEngine, WorkerEngine]:
    tr, (wk,) = await connect_world(store, session0)
    return tr, wk


class HeldStart:
    """Trainer rank 0's store connection, holding its ``sync_weights``' write of round 1's
    start until ``go`` is set: before that write is applied, or just after (its reply
    held). ``publishing`` is set once the write is held. ``close()``'s closing start passes.
    """

    def __init__(self, conn: MemoryStore, *, applied: bool) -> None:
        self.publishing = anyio.Event()
        self.go = anyio.Event()
        real_set, real_cas = conn.set, conn.compare_set

        def held(key: str, value: bytes) -> bool:
            return (key.endswith("/round/1/start") and not self.go.is_set()
                    and not decode_as(value, RoundStart).closing)

        async def around(key: str, value: bytes, write: Any) -> Any:
            if not held(key, value):
                return await write()
            if applied:
                out = await write()
                self.publishing.set()
                await self.go.wait()
                return out
            self.publishing.set()
            await self.go.wait()
            return await write()

        async def set_(key: str, value: bytes, *, ephemeral: bool = False) -> None:
            await around(key, value, lambda: real_set(key, value, ephemeral=ephemeral))

        async def compare_set(key: str, expected: bytes | None, desired: bytes
                              ) -> tuple[bool, bytes | None]:
            out: tuple[bool, bytes | None] = await around(
                key, desired, lambda: real_cas(key, expected, desired))
            return out

        conn.set = set_  # type: ignore[method-assign]
        conn.compare_set = compare_set  # type: ignore[method-assign]


async def round_with_close(tr: TrainerEngine, wk: WorkerEngine, after: float
                           ) -> dict[str, Any]:
    res: dict[str, Any] = {}

    async def send() -> None:
        try:
            res["trainer"] = await tr.sync_weights(source_shards(PLAN, 0, 1))
        except Exception as exc:
            res["trainer"] = exc

    async def receive() -> None:
        try:
            res["worker"] = await wk.receive()
        except Exception as exc:
            res["worker"] = exc

    async def closer() -> None:
        await anyio.sleep(after)
        res["state_before_close"] = tr.state.value
        await tr.close()
        res["state_after_close"] = tr.state.value

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(receive)
            tg.start_soon(closer)
    return res


async def test_close_during_a_round_names_the_closer_not_a_bystander() -> None:
    # Trainer rank 0 has reported ok; the worker enters its part 1.5 s late; rank 0's
    # caller closes the engine meanwhile. The worker is to blame for nothing.
    tr, wk = await connect(MemoryStore())
    _faults.arm([Fault("round.start", "slow", rank=1, seconds=1.5)])
    try:
        res = await round_with_close(tr, wk, after=0.5)
        assert res["state_before_close"] == "updating"
        err = res["worker"]
        assert isinstance(err, TransferError), err
        assert (err.rank, err.cause) == (0, "left"), err
        assert "closed its engine" in str(err), err
    finally:
        _faults.disarm()
        await wk.close()
        await tr.close()


async def test_a_round_that_commits_after_close_leaves_the_engine_closed() -> None:
    # Every rank reports ok, but rank 0's gather of the reports is slow (a loaded store);
    # its caller closes the engine meanwhile. The round commits; the engine stays CLOSED.
    store = MemoryStore()
    s0 = store.session()
    real = s0.gather
    slowed: list[int] = []

    async def gather(prefix: str, n: int, *, watch: Any = ()) -> Any:
        if prefix.endswith("/done/") and n == 2 and not slowed:
            slowed.append(1)
            await anyio.sleep(1.0)
        return await real(prefix, n, watch=watch)

    s0.gather = gather  # type: ignore[method-assign]
    tr, wk = await connect(store, s0)
    try:
        res = await round_with_close(tr, wk, after=0.4)
        assert slowed, "the outcome's gather was not reached"
        assert res["state_before_close"] == "updating"
        assert res["state_after_close"] == "closed"
        assert tr.state.value == "closed", (tr.state, res)
        assert res["trainer"].version == res["worker"].version == 1, res
        # The round committed, so rank 0 left as after it: the job ended cleanly, and the
        # worker's next receive says so (not a round 2 failed by rank 0 "lost").
        with anyio.fail_after(10), pytest.raises(PeerLostError) as lost:
            await wk.receive()
        assert "closed" in str(lost.value) and "lost" not in str(lost.value), lost.value
    finally:
        await wk.close()
        await tr.close()


async def outcome(coro: Any, res: dict[str, Any], name: str) -> None:
    try:
        res[name] = await coro
    except Exception as exc:
        res[name] = exc


async def test_close_before_the_round_is_published_ends_the_job_on_every_rank() -> None:
    store = MemoryStore()
    s0 = store.session()
    hold = HeldStart(s0, applied=False)
    tr, (early, late) = await connect_world(store, s0, PLAN3)
    res: dict[str, Any] = {}
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(outcome, early.receive(), res, "early")
                tg.start_soon(outcome, tr.sync_weights(source_shards(PLAN3, 0, 1)), res,
                              "trainer")
                await hold.publishing.wait()  # sync_weights checked its sources: publishing
                await tr.close()  # its closing start lands first
                hold.go.set()
        await outcome(late.receive(), res, "late")  # a worker asking after all that
        err = res["trainer"]
        assert isinstance(err, TransferError), err
        assert (err.rank, err.cause, err.round) == (0, "left", 1), err
        assert "trainer rank 0 closed its engine before round 1 of generation 1 started" in (
            str(err)), err
        for name in ("early", "late"):  # no round, no failure: the job ended
            assert isinstance(res[name], PeerLostError), (name, res[name])
            assert res[name].ranks == (0,) and "closed the job" in str(res[name]), res[name]
        keys = tr._rounds.core(1).keys  # type: ignore[union-attr]
        start = await store.get(keys.start)
        assert start is not None and decode_as(start, RoundStart).closing
        assert await store.get(keys.abort) is None  # nothing beside the closing start
        assert tr.state.value == "closed" and early.version == late.version == 0
    finally:
        await _close_all(early, late, tr)


async def test_close_after_the_round_is_published_fails_it_on_every_rank_at_once() -> None:
    store = MemoryStore()
    s0 = store.session()
    hold = HeldStart(s0, applied=True)
    tr, wk = await connect(store, s0)
    res: dict[str, Any] = {}
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(outcome, wk.receive(), res, "worker")
                tg.start_soon(outcome, tr.sync_weights(source_shards(PLAN, 0, 1)), res,
                              "trainer")
                await hold.publishing.wait()  # round 1's start is in; sync_weights waits
                await tr.close()  # its closing start loses: round 1 has begun
                # The peers were told before close() returned: the round's record names
                # rank 0 (not a clean leave that the worker's poll finds a second later).
                raw = await store.get(tr._rounds.core(1).keys.abort)  # type: ignore[union-attr]
                assert raw is not None
                record = decode_as(raw, Abort)
                assert (record.rank, record.cause) == (0, "left"), record
                hold.go.set()
        errs = [res["trainer"], res["worker"]]
        assert all(isinstance(e, TransferError) for e in errs), errs
        assert {(e.rank, e.cause) for e in errs} == {(0, "left")}, errs
        assert str(errs[0]) == str(errs[1]), errs
        assert "closed its engine during round 1" in str(errs[0]), errs
        assert tr.state.value == "closed" and wk.version == 0
    finally:
        await _close_all(wk, tr)


async def _close_all(*engines: Any) -> None:
    for e in engines:
        await e.close()
