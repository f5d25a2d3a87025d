"""``close()`` while this engine's round is still in progress, on a ``MemoryStore``.

Two orders: the closing rank's peers are still in the round (the round must fail on every
rank naming the closer, not a bystander whose transfer then breaks), and every rank already
reported ok while the closer still gathered the reports (the round commits, yet the closed
engine stays CLOSED).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from m2n_async import EngineConfig, TrainerEngine, TransferError, WorkerEngine
from m2n_async._engine import _faults
from m2n_async._engine._faults import Fault
from m2n_async.testing import MemoryStore

from ._plans import R, empty_targets, make_plan, source_shards

pytestmark = pytest.mark.asyncio

CFG = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2, phase_timeout=20,
                   round_timeout=20, abort_grace=2, host="127.0.0.1")
PLAN = make_plan([("w", (12, 6), torch.float32, (R, 0), (R, 1))], (1, 1), (1, 1))


async def connect(store: MemoryStore, session0: Any = None
                  ) -> tuple[TrainerEngine, WorkerEngine]:
    specs = [p.spec for p in PLAN.params]
    out: dict[int, Any] = {}

    async def trainer() -> None:
        out[0] = await TrainerEngine.connect(store=session0 or store.session(), rank=0,
                                             trainer_ranks=1, world_size=2, params=specs,
                                             config=CFG)

    async def worker() -> None:
        targets = {p.spec.name: (t, p.dst.placements) for (_, t), p in
                   zip(empty_targets(PLAN, 1).items(), PLAN.params, strict=True)}
        out[1] = await WorkerEngine.connect(store=store.session(), rank=1, trainer_ranks=1,
                                            world_size=2, targets=targets,
                                            mesh_dims=PLAN.params[0].dst.mesh.dims,
                                            config=CFG)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            tg.start_soon(worker)
    return out[0], out[1]


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
    finally:
        await wk.close()
        await tr.close()
