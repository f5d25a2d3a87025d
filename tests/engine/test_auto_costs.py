"""``transport="auto"`` by predicted cost, through the engine: the config and environment
routes to the cost terms, their agreement across ranks, and ``SyncResult.predicted_seconds``."""

from __future__ import annotations

import anyio
import pytest
import torch

from m2n_async import EngineConfig, PlanError, PreflightError, TrainerEngine, WorkerEngine
from m2n_async._proto.cost import COSTS_ENV, DEFAULT_LANES
from m2n_async.testing import MemoryStore

from ._plans import R, empty_targets, expected_shards, make_plan, source_shards

PLAN = make_plan([("w", (8, 4), torch.float32, None, (R, 1)),
                  ("b", (8,), torch.float32, None, None)], (1, 1), (1, 1))


async def _world(trainer_cfg: EngineConfig, worker_cfg: EngineConfig
                 ) -> tuple[TrainerEngine | BaseException, WorkerEngine | BaseException]:
    store = MemoryStore()
    out: dict[int, object] = {}
    targets = {n: (t, p.dst.placements)
               for (n, t), p in zip(empty_targets(PLAN, 1).items(), PLAN.params, strict=True)}

    async def one(r: int) -> None:
        try:
            if r == 0:
                out[r] = await TrainerEngine.connect(
                    store=store.session(), rank=0, trainer_ranks=1, world_size=2,
                    params=[p.spec for p in PLAN.params], config=trainer_cfg)
            else:
                out[r] = await WorkerEngine.connect(
                    store=store.session(), rank=1, trainer_ranks=1, world_size=2,
                    targets=targets, mesh_dims=(1, 1), config=worker_cfg)
        except Exception as exc:
            out[r] = exc

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
    return out[0], out[1]  # type: ignore[return-value]


def _cfg(**kw: object) -> EngineConfig:
    return EngineConfig(phase_timeout=20, round_timeout=20, abort_grace=2, host="127.0.0.1",
                        **kw)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_auto_reports_the_prediction_beside_the_measurement() -> None:
    trainer, worker = await _world(_cfg(), _cfg())
    assert isinstance(trainer, TrainerEngine) and isinstance(worker, WorkerEngine)
    try:
        assert trainer.transport == "gloo"  # the one lane a CPU host runs
        assert "predicted" in trainer.transport_reason and "gloo" in trainer.transport_reason
        results = {}

        async def send() -> None:
            results[0] = await trainer.sync_weights(source_shards(PLAN, 0))

        async def recv() -> None:
            results[1] = await worker.receive()

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(recv)
        for res in results.values():
            assert res.predicted_seconds is not None and res.predicted_seconds > 0
            assert res.seconds > 0
        for name, want in expected_shards(PLAN, 1).items():
            got = worker._sinks[name].tensor
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # NaN bytes
    finally:
        await trainer.close()
        await worker.close()


@pytest.mark.asyncio
async def test_ranks_with_different_cost_terms_fail_preflight_naming_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the worker calibrated from the environment, the trainer did not
    monkeypatch.setenv(COSTS_ENV, '{"gloo": [0.002, 0, 1e9]}')
    trainer, worker = await _world(_cfg(costs={"gloo": DEFAULT_LANES["gloo"]}), _cfg())
    for got in (trainer, worker):
        assert isinstance(got, PreflightError), got
        assert got.phase == "destination"
        assert "cost inputs" in str(got)


def test_cost_terms_are_validated_in_the_config() -> None:
    EngineConfig(costs={"m2n": (1e-4, 0.0, 3e11)})
    for bad in ({"m2n": (1e-4, 0.0)}, {"tcp": (1, 1, 1)}, {"m2n": (1, 1, 0)}, [("m2n", 1)]):
        with pytest.raises(PlanError):
            EngineConfig(costs=bad)  # type: ignore[arg-type]
