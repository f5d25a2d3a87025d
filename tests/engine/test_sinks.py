"""A worker's targets become one ``Sink`` record per name, once, at connect: the user's
mapping is read in one pass, the lanes get the engine's ``SinkMap`` itself every bucket (no
conversion, no second look at the targets), and a malformed target is refused with the
error naming its parameter — not before connecting, where the peers already in the handshake
would wait out its phase for this worker, but in its first phase, so every rank raises that
error at once. Every rank is a task of one event loop (real Gloo)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import pytest
import torch

from m2n_async import (
    EngineConfig,
    LoadTarget,
    LocalProtocolError,
    PreflightError,
    TrainerEngine,
    WorkerEngine,
)
from m2n_async._data import _transport
from m2n_async._data._transport import Sink, SinkMap
from m2n_async._engine import _engine
from m2n_async.testing import MemoryStore

from ._plans import ParamDef, R, empty_targets, expected_shards, make_plan, source_shards

CFG = EngineConfig(transport="gloo", bucket_bytes=256, max_inflight=2, phase_timeout=20,
                   round_timeout=20, abort_grace=2, host="127.0.0.1")

DEFS: list[ParamDef] = [
    ("w_row", (12, 6), torch.float32, (R, 0), (R, 1)),
    ("w_col", (12, 6), torch.bfloat16, (R, 1), (R, 0)),
    ("loaded", (6, 4), torch.float32, None, (R, 0)),
    ("rep", (6, 4), torch.float16, None, None),
]


class _CountingTargets(Mapping[str, Any]):
    """A targets mapping that counts how often it is read."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data
        self.lookups = 0
        self.passes = 0

    def __getitem__(self, name: str) -> Any:
        self.lookups += 1
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        self.passes += 1
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@pytest.mark.asyncio
async def test_targets_become_records_once_per_connect(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    plan = make_plan(DEFS, (1, 2), (1, 2))
    t, w = plan.trainer_ranks, plan.world_size
    loaded: dict[int, torch.Tensor] = {}
    targets: dict[int, _CountingTargets] = {}
    for r in range(t, w):
        data: dict[str, Any] = {p.spec.name: (x, p.dst.placements) for (_, x), p in
                                zip(empty_targets(plan, r).items(), plan.params, strict=True)}
        p = plan.params[2]
        data["loaded"] = LoadTarget(p.dst.local_shape(p.spec.shape, r), torch.float32,
                                    p.dst.placements,
                                    lambda n, x, r=r: loaded.__setitem__(r, x.clone()))
        targets[r] = _CountingTargets(data)
    made: list[str] = []
    real_sink_of = _engine._sink_of

    def counting_sink_of(name: str, target: Any) -> Sink:
        made.append(name)
        return real_sink_of(name, target)

    converted: list[object] = []
    real_sink_map = _transport.sink_map

    def counting_sink_map(sinks: Any) -> SinkMap:
        converted.append(sinks)
        return real_sink_map(sinks)

    monkeypatch.setattr(_engine, "_sink_of", counting_sink_of)
    monkeypatch.setattr(_transport, "sink_map", counting_sink_map)
    store = MemoryStore()
    engines: dict[int, Any] = {}

    async def connect(r: int) -> None:
        if r < t:
            engines[r] = await TrainerEngine.connect(
                store=store.session(), rank=r, trainer_ranks=t, world_size=w,
                params=[p.spec for p in plan.params], config=CFG)
        else:
            engines[r] = await WorkerEngine.connect(
                store=store.session(), rank=r, trainer_ranks=t, world_size=w,
                targets=targets[r], mesh_dims=(1, 2), config=CFG)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for r in range(w):
                tg.start_soon(connect, r)
    workers: list[WorkerEngine] = [engines[r] for r in range(t, w)]
    names = [p.spec.name for p in plan.params]
    try:
        assert sorted(made) == sorted(names * len(workers))  # one record per target
        for e in workers:
            assert (targets[e.rank].passes, targets[e.rank].lookups) == (1, len(names))
            assert isinstance(e._sinks, SinkMap)
            assert {n: s.in_place for n, s in e._sinks.items()} == {
                n: n != "loaded" for n in names}
            assert e._sinks["loaded"].declared is targets[e.rank]._data["loaded"]
            assert e._transport is not None
            assert e._transport.ctx.in_place == frozenset(
                i for i, n in enumerate(names) if n != "loaded")
        handed: list[object] = []
        for e in workers:  # what the lanes get, every bucket
            tr = e._transport
            assert tr is not None
            stage, unpack = tr.stage, tr.unpack

            async def spy_stage(bucket: Any, *, sources: Any = None, sinks: Any = None,
                                stage: Any = stage) -> Any:
                handed.append(sinks)
                return await stage(bucket, sources=sources, sinks=sinks)

            async def spy_unpack(staging: Any, sinks: Any, unpack: Any = unpack) -> None:
                handed.append(sinks)
                await unpack(staging, sinks)

            monkeypatch.setattr(tr, "stage", spy_stage)
            monkeypatch.setattr(tr, "unpack", spy_unpack)
        for version in (1, 2):
            async def send(e: TrainerEngine, v: int = version) -> None:
                await e.sync_weights(source_shards(plan, e.rank, v))

            async def recv(e: WorkerEngine) -> None:
                await e.receive()

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for r in range(t):
                        tg.start_soon(send, engines[r])
                    for e in workers:
                        tg.start_soon(recv, e)
            for e in workers:
                want = expected_shards(plan, e.rank, version)
                for n in names:
                    got = loaded[e.rank] if n == "loaded" else e._sinks[n].tensor
                    assert torch.equal(got.reshape(-1).view(torch.uint8),
                                       want[n].reshape(-1).view(torch.uint8)), (e.rank, n)
        buckets = len(workers[0]._transport.ctx.buckets)  # type: ignore[union-attr]
        assert buckets > 1 and len(handed) == 2 * 2 * len(workers) * buckets
        assert {id(s) for s in handed} == {id(e._sinks) for e in workers}
        # after connect: no target read again, no record made again, nothing converted
        for e in workers:
            assert (targets[e.rank].passes, targets[e.rank].lookups) == (1, len(names))
        assert len(made) == len(names) * len(workers)
        assert converted == []
    finally:
        for r in range(w):
            await engines[r].close()


#: The hint of a malformed target's error, after "got {kind}; ".
HINT = ("e.g. (t, None) for a replicated tensor, (t, (REPLICATE, d)) for a shard of dim d "
        "along the TP axis")
#: Far beyond the bound of each case: a peer left waiting for the worker fails the test.
LONG_PHASE = dataclasses.replace(CFG, phase_timeout=60)
CASE_BOUND = 10.0


async def _connect_with(targets: Any, mesh_dims: Any = (1, 1), params: Any = None
                        ) -> tuple[dict[str, BaseException | str], dict[str, float]]:
    """Trainer 0 (with ``params``, default the plan's specs) and worker 1 (with
    ``targets``) connect; what each raised, and when."""
    plan = make_plan(DEFS[:1], (1, 1), (1, 1))
    if params is None:
        params = [p.spec for p in plan.params]
    store = MemoryStore()
    got: dict[str, BaseException | str] = {}
    when: dict[str, float] = {}

    async def connect(side: str) -> None:
        try:
            if side == "trainer":
                e: Any = await TrainerEngine.connect(
                    store=store.session(), rank=0, trainer_ranks=1, world_size=2,
                    params=params, config=LONG_PHASE)
            else:
                e = await WorkerEngine.connect(
                    store=store.session(), rank=1, trainer_ranks=1, world_size=2,
                    targets=targets, mesh_dims=mesh_dims, config=LONG_PHASE)
            got[side] = "connected"
            await e.close()
        except Exception as exc:
            got[side] = exc
        when[side] = time.monotonic()

    with anyio.fail_after(CASE_BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(connect, "worker")
            tg.start_soon(connect, "trainer")
    return got, when


def _same_preflight_error(got: dict[str, BaseException | str], when: dict[str, float],
                          phase: str, culprit: int = 1) -> str:
    """Both sides raised one PreflightError of ``phase`` naming rank ``culprit``, within a
    second of each other; the culprit's diagnosis."""
    worker, trainer = got["worker"], got["trainer"]
    for exc in (worker, trainer):
        assert isinstance(exc, PreflightError), got
        assert (exc.phase, list(exc.failures)) == (phase, [culprit]), exc
    assert isinstance(worker, PreflightError) and isinstance(trainer, PreflightError)
    assert str(trainer) == str(worker) and trainer.failures == worker.failures
    assert abs(when["trainer"] - when["worker"]) < 1.0, when
    return worker.failures[culprit]


@pytest.mark.asyncio
@pytest.mark.parametrize("target, kind", [
    (torch.zeros(12, 3), "Tensor"),
    ((torch.zeros(12, 3),), "tuple"),
    ((torch.zeros(12, 3), (R, 1), "extra"), "tuple"),
    (None, "NoneType"),
    (lambda name, tensor: None, "function"),
], ids=["bare-tensor", "1-tuple", "3-tuple", "none", "callable"])
async def test_a_malformed_target_fails_hello_on_every_rank_naming_its_parameter(
        target: Any, kind: str) -> None:
    got, when = await _connect_with({"w_row": target})
    text = (f"target for parameter 'w_row' must be (tensor, placements) or a LoadTarget, "
            f"got {kind}; {HINT}")
    assert _same_preflight_error(got, when, "hello") == (
        f"local step failed: LocalProtocolError: {text}")
    # The worker's own error keeps the refusal it found, with its traceback.
    cause = got["worker"].__cause__  # type: ignore[union-attr]
    assert isinstance(cause, LocalProtocolError) and str(cause) == text


@pytest.mark.asyncio
@pytest.mark.parametrize("params, says", [
    (torch.nn.Linear(3, 12), "params must be a sequence of ParamSpec, got Linear"),
    ({"w_row": None}, "params must be a sequence of ParamSpec, got dict"),
    ([torch.zeros(12, 3)], "params[0] must be a ParamSpec, got Tensor"),
], ids=["module", "mapping", "tensor"])
async def test_trainer_params_that_are_no_specs_fail_hello_on_every_rank(
        params: Any, says: str) -> None:
    # The trainer's twin of a malformed target: the workers do not wait out phase_timeout.
    got, when = await _connect_with({"w_row": (torch.zeros(12, 3), (R, 1))}, params=params)
    text = (f"{says}; e.g. specs_from_module(model) or [ParamSpec(name, dtype, "
            f"shape, layout)]")
    assert _same_preflight_error(got, when, "hello", culprit=0) == (
        f"local step failed: LocalProtocolError: {text}")
    cause = got["trainer"].__cause__  # type: ignore[union-attr]
    assert isinstance(cause, LocalProtocolError) and str(cause) == text


@pytest.mark.asyncio
async def test_targets_that_are_no_mapping_fail_hello_on_every_rank() -> None:
    pairs = [("w_row", (torch.zeros(12, 3), (R, 1)))]  # dict(...) forgotten
    got, when = await _connect_with(pairs)
    assert _same_preflight_error(got, when, "hello") == (
        "local step failed: LocalProtocolError: targets must be a mapping of parameter name "
        "-> (tensor, placements) or LoadTarget, got list; e.g. targets_from_module(model, "
        "tp_plan)")


@pytest.mark.asyncio
@pytest.mark.parametrize("placements, mesh_dims, says", [
    (0, (1, 1), "parameter 'w_row' (destination side): placements must be two ints "
                "(REPLICATE or a tensor dim), got 0"),
    ((R, 1), 1, "worker rank 1: mesh_dims must be two positive ints (replicas, tp), got 1"),
], ids=["placements-int", "mesh-dims-int"])
async def test_placements_or_mesh_dims_that_are_no_pair_fail_destination_on_every_rank(
        placements: Any, mesh_dims: Any, says: str) -> None:
    got, when = await _connect_with({"w_row": (torch.zeros(12, 3), placements)}, mesh_dims)
    assert _same_preflight_error(got, when, "destination") == (
        f"local step failed: PlanError: {says}")


@pytest.mark.asyncio
async def test_a_refused_target_is_noted_when_the_handshake_never_reports_it() -> None:
    # No trainer: rank 0 never opens the generation, so hello never runs.
    cfg = dataclasses.replace(CFG, phase_timeout=0.2)
    with anyio.fail_after(CASE_BOUND), pytest.raises(TimeoutError) as info:
        await WorkerEngine.connect(store=MemoryStore(), rank=1, trainer_ranks=1, world_size=2,
                                   targets={"w_row": torch.zeros(12, 3)}, config=cfg)
    assert "trainer rank 0 did not open generation 1" in str(info.value)
    assert info.value.__notes__ == [
        "rank 1 waited 0.2 s for it",
        "rank 1 refused its own arguments before the handshake, which failed before it could "
        "report that: LocalProtocolError: target for parameter 'w_row' must be (tensor, "
        f"placements) or a LoadTarget, got Tensor; {HINT}"]
