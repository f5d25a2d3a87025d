"""A rank that refuses its own inputs — a trainer's params, a worker's target, the cost terms
it reads — fails the handshake on every rank at once, with one ``PreflightError`` naming
that rank and why, wherever it found the refusal and whichever rank arrived last.

Engines end to end, every rank a task of one event loop over a ``MemoryStore`` (real Gloo).
The phase deadline is far beyond the bound each test asserts: a rank that waits it out for
the refusing rank fails the test.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import msgspec
import pytest
import torch

from m2n_async import EngineConfig, PreflightError, TrainerEngine, WorkerEngine
from m2n_async._proto.cost import COSTS_ENV, DEFAULT_LANES
from m2n_async._proto.layout import Layout, Mesh
from m2n_async.testing import MemoryStore

from ._plans import ParamDef, R, empty_targets, make_plan

T, N = 2, 2  # trainer 1 is a trainer other than rank 0; workers are ranks 2 and 3
PHASE_TIMEOUT = 60.0
BOUND_S = 15.0  # well before the phase deadline, with room for a loaded 2-core host
CFG = EngineConfig(transport="gloo", bucket_bytes=512, max_inflight=2,
                   phase_timeout=PHASE_TIMEOUT, round_timeout=PHASE_TIMEOUT, abort_grace=2,
                   host="127.0.0.1")
DEFS: list[ParamDef] = [("w", (12, 6), torch.float32, (R, 0), (R, 1))]
PLAN = make_plan(DEFS, (T, 1), (1, N))
SPECS = [p.spec for p in PLAN.params]


def _targets(rank: int) -> dict[str, Any]:
    return {p.spec.name: (x, p.dst.placements)
            for (_, x), p in zip(empty_targets(PLAN, rank).items(), PLAN.params, strict=True)}


@dataclass
class _World:
    """What each rank raised (or ``"connected"``), when it ended, and when the last rank
    began to connect (monotonic seconds)."""

    got: dict[int, BaseException | str] = field(default_factory=dict)
    done: dict[int, float] = field(default_factory=dict)
    last_start: float = 0.0


async def _connect_all(*, params: Mapping[int, Any] | None = None,
                       targets: Mapping[int, Any] | None = None,
                       configs: Mapping[int, EngineConfig] | None = None,
                       delays: Mapping[int, float] | None = None) -> _World:
    """Every rank of the 2+2 world connects, rank r after ``delays[r]`` seconds, with its
    ``params`` (trainers), ``targets`` (workers) and config where given."""
    store = MemoryStore()
    world = _World()

    async def one(r: int) -> None:
        await anyio.sleep((delays or {}).get(r, 0.0))
        world.last_start = max(world.last_start, time.monotonic())
        cfg = (configs or {}).get(r, CFG)
        try:
            if r < T:
                e: Any = await TrainerEngine.connect(
                    store=store.session(), rank=r, trainer_ranks=T, world_size=T + N,
                    params=(params or {}).get(r, SPECS), config=cfg)
            else:
                e = await WorkerEngine.connect(
                    store=store.session(), rank=r, trainer_ranks=T, world_size=T + N,
                    targets=(targets or {}).get(r) or _targets(r), mesh_dims=(1, N),
                    config=cfg)
            world.got[r] = "connected"
            await e.close()
        except Exception as exc:
            world.got[r] = exc
        world.done[r] = time.monotonic()

    # A bound for the test itself, beyond the phase deadline: a rank that waits the phase
    # out still shows up as a failed assertion below, not as a hung test.
    with anyio.fail_after(PHASE_TIMEOUT + 30):
        async with anyio.create_task_group() as tg:
            for r in range(T + N):
                tg.start_soon(one, r)
    return world


def _one_diagnosis(world: _World, phase: str, culprit: int) -> str:
    """Every rank raised one PreflightError of ``phase`` naming ``culprit`` alone, well
    before the phase deadline once the last rank arrived; the culprit's diagnosis."""
    errors = {}
    for r in range(T + N):
        exc = world.got[r]
        assert isinstance(exc, PreflightError), (r, world.got)
        errors[r] = exc
        assert world.done[r] - world.last_start < BOUND_S, (r, world.done, world.last_start)
    first = errors[0]
    assert first.phase == phase and list(first.failures) == [culprit], first
    assert len({str(e) for e in errors.values()}) == 1, errors
    return first.failures[culprit]


@pytest.mark.asyncio
@pytest.mark.parametrize("rank_0_late", [False, True], ids=["together", "rank-0-late"])
async def test_a_trainer_other_than_0_whose_params_are_no_specs_fails_every_rank_at_once(
        rank_0_late: bool) -> None:
    # Refused before the handshake (a module passed as it is); with rank 0 late, trainer 1
    # is already waiting for rank 0's generation when it comes.
    world = await _connect_all(params={1: torch.nn.Linear(6, 12)},
                               delays={0: 1.0} if rank_0_late else None)
    why = _one_diagnosis(world, "hello", culprit=1)
    assert why.startswith("local step failed: LocalProtocolError: params must be a sequence "
                          "of ParamSpec, got Linear"), why


@pytest.mark.asyncio
async def test_a_trainer_other_than_0_whose_specs_are_invalid_fails_every_rank_at_once(
        ) -> None:
    # Refused in the handshake: specs on a mesh that is not the trainers' (the source
    # phase's own check of trainer 1's specs).
    wrong = [msgspec.structs.replace(s, layout=Layout(Mesh((1, 1)), None)) for s in SPECS]
    world = await _connect_all(params={1: wrong})
    why = _one_diagnosis(world, "source", culprit=1)
    assert why.startswith("local step failed: PlanError: parameter 'w' (source side): mesh "
                          "(1, 1) starting at rank 0 covers ranks [0, 1) but the source ranks "
                          "are exactly [0, 2)"), why


@pytest.mark.asyncio
async def test_a_worker_refusing_its_target_before_rank_0_arrives_fails_rank_0_at_once(
        ) -> None:
    # Worker 3 refuses its target (a bare tensor) and waits for rank 0's generation; rank 0,
    # when it comes, raises that diagnosis at once instead of waiting out hello for it.
    world = await _connect_all(targets={3: {"w": torch.zeros(12, 3)}}, delays={0: 1.0})
    why = _one_diagnosis(world, "hello", culprit=3)
    assert why.startswith("local step failed: LocalProtocolError: target for parameter 'w' "
                          "must be (tensor, placements) or a LoadTarget, got Tensor"), why


@pytest.mark.asyncio
@pytest.mark.parametrize("culprit", [1, 3], ids=["trainer-1", "worker-3"])
async def test_a_rank_whose_cost_terms_do_not_parse_fails_every_rank_alike(
        monkeypatch: pytest.MonkeyPatch, culprit: int) -> None:
    # The variable is read by the rank whose config gives no cost terms: the culprit alone
    # here (the others' explicit terms are the defaults, what they would read without it).
    monkeypatch.setenv(COSTS_ENV, "{not json")
    explicit = replace(CFG, costs=dict(DEFAULT_LANES))
    world = await _connect_all(configs={r: explicit for r in range(T + N) if r != culprit})
    why = _one_diagnosis(world, "hello", culprit=culprit)
    assert why.startswith(f"local step failed: PlanError: {COSTS_ENV}: cost terms must be "
                          f"JSON like"), why
