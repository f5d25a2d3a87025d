"""Mixed-precision trainers through the public API on the Gloo lane (real Gloo, one loop).

A trainer may hand in shards of another float dtype than the wire's (fp32 master weights,
bf16 on the wire): the transport casts while packing and the workers' bytes equal
``shard.to(wire_dtype)`` exactly. Any other conversion is refused before the round (dict,
module) with nothing sent and the engine still READY; ``SyncResult.cast_bytes`` counts the
cast bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from m2n_async import (
    EngineConfig,
    PlanError,
    SyncResult,
    TrainerEngine,
    WorkerEngine,
    specs_from_module,
)
from m2n_async._data._packing import DIRECT_MIN_BYTES
from m2n_async._proto.plan import TransferPlan
from m2n_async.testing import MemoryStore

from ._plans import ParamDef, R, local_shard, make_plan

CFG = EngineConfig(transport="gloo", bucket_bytes=4096, max_inflight=2, phase_timeout=20,
                   round_timeout=20, abort_grace=2, host="127.0.0.1")

# Wire dtypes of the plan; every float one is fed from fp32 (or fp64) masters below.
DEFS: list[ParamDef] = [
    ("flag", (3,), torch.uint8, None, None),            # 3 bytes: misaligns what follows
    ("odd", (6,), torch.bfloat16, None, (R, 0)),        # cast into an unaligned offset
    ("w_row", (12, 12), torch.bfloat16, (R, 0), (R, 1)),  # strided on the worker
    ("w_col", (12, 12), torch.float16, (R, 1), (R, 0)),   # strided on the trainer
    ("experts", (4, 6, 6), torch.bfloat16, (R, 0), (R, 2)),
    ("scalar", (), torch.bfloat16, None, None),
    ("steps", (6,), torch.int32, None, (R, 0)),         # not cast: int stays int
    # Pieces of their own (>= DIRECT_MIN_BYTES on the wire): zero-copy when not cast.
    ("big", (3 * DIRECT_MIN_BYTES // 2 // 64, 64), torch.bfloat16, (R, 0), (R, 0)),
]


def master(name: str, shape: tuple[int, ...], dtype: torch.dtype, version: int = 0
           ) -> torch.Tensor:
    """A full fp32 (or int) tensor whose values mostly need rounding to the wire dtype,
    with exact ties (round half to even), subnormals, infinities and NaN among them."""
    g = torch.Generator().manual_seed(sum(name.encode()) * 31 + version)
    n = torch.Size(shape).numel()
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g, dtype=dtype)
    t = torch.randn(n, generator=g) * 10
    specials = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1e-40, -3e-39,
                             float("inf"), float("-inf"), float("nan"), 65519.0, 1e6, 0.0,
                             -0.0, 2.0**-24, 1.00048828125])
    k = min(n, len(specials))
    t[:k] = specials[:k]
    return t.reshape(shape)


def src_dtype(wire: str) -> torch.dtype:
    return torch.float64 if wire == "float16" else torch.float32  # both casts exercised


def sources(plan: TransferPlan, rank: int, version: int = 0, *, cast: bool = True
            ) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        s = p.spec
        wire = getattr(torch, s.dtype)
        full = master(s.name, s.shape, wire, version)
        if wire.is_floating_point:
            full = full.to(src_dtype(s.dtype)) if cast else full.to(wire)
        out[s.name] = local_shard(full, s.layout, rank)
    return out


def expected(plan: TransferPlan, rank: int, version: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        s = p.spec
        wire = getattr(torch, s.dtype)
        full = master(s.name, s.shape, wire, version)
        if wire.is_floating_point:
            full = full.to(src_dtype(s.dtype)).to(wire)  # exactly what Tensor.to gives
        out[s.name] = local_shard(full, p.dst, rank)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def cast_bytes_of(plan: TransferPlan, rank: int, srcs: Mapping[str, torch.Tensor]) -> int:
    return sum(piece.nbytes for i, p in enumerate(plan.params)
               if srcs[p.spec.name].dtype != getattr(torch, p.spec.dtype)
               for piece in plan.pieces_from(i, rank))


async def connect(store: MemoryStore, plan: TransferPlan, targets: dict[int, dict[str, Any]]
                  ) -> tuple[list[TrainerEngine], list[WorkerEngine]]:
    t, w = plan.trainer_ranks, plan.world_size
    specs = [p.spec for p in plan.params]
    out: dict[int, Any] = {}

    async def one(r: int) -> None:
        if r < t:
            out[r] = await TrainerEngine.connect(store=store.session(), rank=r,
                                                 trainer_ranks=t, world_size=w, params=specs,
                                                 config=CFG)
        else:
            out[r] = await WorkerEngine.connect(
                store=store.session(), rank=r, trainer_ranks=t, world_size=w,
                targets={n: (x, plan.params[plan.index(n)].dst.placements)
                         for n, x in targets[r].items()},
                mesh_dims=plan.params[0].dst.mesh.dims, config=CFG)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for r in range(w):
                tg.start_soon(one, r)
    return [out[r] for r in range(t)], [out[r] for r in range(t, w)]


def zeros(plan: TransferPlan, rank: int) -> dict[str, torch.Tensor]:
    return {p.spec.name: torch.zeros(p.dst.local_shape(p.spec.shape, rank),
                                     dtype=getattr(torch, p.spec.dtype)) for p in plan.params}


async def one_round(trainers: list[TrainerEngine], workers: list[WorkerEngine],
                    weights: dict[int, Any]) -> dict[int, SyncResult]:
    results: dict[int, SyncResult] = {}

    async def tr(e: TrainerEngine) -> None:
        results[e.rank] = await e.sync_weights(weights[e.rank])

    async def wk(e: WorkerEngine) -> None:
        results[e.rank] = await e.receive()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for e in trainers:
                tg.start_soon(tr, e)
            for w in workers:
                tg.start_soon(wk, w)
    return results


async def close(*engines: Any) -> None:
    for e in engines:
        await e.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("dims", [((1, 2), (1, 2)), ((2, 1), (1, 3))],
                         ids=["2+2", "2rep+3"])
async def test_cast_while_packing_is_bit_exact_and_counted(dims: Any) -> None:
    plan = make_plan(DEFS, *dims)
    store = MemoryStore()
    targets = {r: zeros(plan, r) for r in range(plan.trainer_ranks, plan.world_size)}
    trainers, workers = await connect(store, plan, targets)
    try:
        # Rounds alternate uncast (zero-copy where the layout allows) and cast sources: the
        # staging grows for the cast rounds and the cached copies follow the dtypes.
        for version, cast in enumerate([True, False, True], start=1):
            srcs = {e.rank: sources(plan, e.rank, version, cast=cast) for e in trainers}
            results = await one_round(trainers, workers, srcs)
            for w in workers:
                want = expected(plan, w.rank, version) if cast else {
                    n: local_shard(src_full, plan.params[plan.index(n)].dst, w.rank)
                    for n, src_full in _wire_fulls(plan, version).items()}
                for n, t in targets[w.rank].items():
                    assert same_bytes(t, want[n]), (version, w.rank, n)
                assert results[w.rank].cast_bytes == 0
            if cast:  # the uint8 and int32 parameters are not cast
                assert 0 < sum(results[e.rank].cast_bytes for e in trainers) < sum(
                    results[e.rank].bytes for e in trainers)
            for e in trainers:
                res = results[e.rank]
                assert res.version == version and res.round == version
                assert res.cast_bytes == (cast_bytes_of(plan, e.rank, srcs[e.rank])
                                          if cast else 0), (version, e.rank)
                if cast:
                    assert res.cast_bytes > 0
                    # the cast lands in the staging the pipeline bounds anyway, but for the
                    # temporaries of pieces cast at unaligned offsets (counted: at most
                    # their wire bytes, so at most the bytes cast)
                    assert 0 < res.peak_extra_bytes <= CFG.max_inflight * max(
                        b.nbytes for b in plan.buckets(4096)) + res.cast_bytes
    finally:
        await close(*trainers, *workers)


def _wire_fulls(plan: TransferPlan, version: int) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        wire = getattr(torch, p.spec.dtype)
        full = master(p.spec.name, p.spec.shape, wire, version)
        out[p.spec.name] = full.to(wire)
    return out


# -- refused before the round -----------------------------------------------------------------

REFUSED = [
    ("int->float", torch.bfloat16, torch.int32),
    ("float->int", torch.int32, torch.float32),
    ("float->fp8", torch.float8_e4m3fn, torch.float32),
    ("fp8->float", torch.bfloat16, torch.float8_e5m2),
    ("bool", torch.bfloat16, torch.bool),
    ("int widths", torch.int64, torch.int32),
]


def _bad_plan(wire: torch.dtype) -> TransferPlan:
    return make_plan([("ok", (8, 4), torch.bfloat16, (R, 0), None),
                      ("bad", (8, 4), wire, (R, 0), (R, 1))], (1, 2), (1, 2))


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["dict", "module"])
@pytest.mark.parametrize(("case", "wire", "given"), REFUSED, ids=[c[0] for c in REFUSED])
async def test_refused_before_the_round_engine_stays_ready(how: str, case: str,
                                                           wire: torch.dtype,
                                                           given: torch.dtype) -> None:
    plan = _bad_plan(wire)
    store = MemoryStore()
    targets = {r: zeros(plan, r) for r in range(plan.trainer_ranks, plan.world_size)}
    trainers, workers = await connect(store, plan, targets)

    def bad_weights(rank: int) -> Any:
        good = sources(plan, rank, 1)
        raw = torch.zeros(good["bad"].shape).to(given)
        if how == "dict":
            return {"ok": good["ok"], "bad": raw}
        m = nn.Module()
        m.ok = nn.Parameter(good["ok"].float())  # a float cast: accepted
        m.bad = nn.Parameter(raw, requires_grad=False)
        return m

    try:
        received: list[SyncResult] = []

        async def receive(w: WorkerEngine) -> None:
            received.append(await w.receive())

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for w in workers:
                    tg.start_soon(receive, w)
                for e in trainers:
                    with pytest.raises(PlanError) as info:
                        await e.sync_weights(bad_weights(e.rank))
                    msg = str(info.value)
                    assert "'bad'" in msg and f"rank {e.rank}" in msg, msg
                    assert str(given).removeprefix("torch.") in msg, msg
                    assert str(wire).removeprefix("torch.") in msg, msg
                    assert e.state.value == "ready" and e.version == 0
                await anyio.sleep(0.05)
                assert received == []  # no round started: the workers still wait
                # The same engines then run a good round, as round 1.
                good = {e.rank: sources(plan, e.rank, 1, cast=False) for e in trainers}
                res = await one_round(trainers, [], good)
        assert [r.round for r in received] == [1, 1] and res[0].round == 1
        for w in workers:
            assert w.state.value == "ready" and w.version == 1
    finally:
        await close(*trainers, *workers)


BROKEN = {
    "missing": lambda t: None,
    "shape": lambda t: torch.cat([t.reshape(-1), t.reshape(-1)]),
    "noncontiguous": lambda t: torch.stack([t, t], dim=-1)[..., 0],
    "device": lambda t: t.to("meta"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["ok", "rep"])
@pytest.mark.parametrize("fault", sorted(BROKEN))
async def test_a_bad_shard_of_a_dict_is_refused_before_the_round_on_every_trainer(
        fault: str, name: str) -> None:
    """A dict missing a name, or holding a shard of another local shape, device or layout, is
    refused on every trainer before the round, as a bad dtype is: each trainer checks every
    parameter (``rep`` is sent by one trainer only), nothing moves and the engines stay
    READY for the next round."""
    plan = make_plan([("ok", (8, 4), torch.bfloat16, (R, 0), None),
                      ("rep", (6,), torch.float32, None, (R, 0))], (1, 2), (1, 2))
    store = MemoryStore()
    targets = {r: zeros(plan, r) for r in range(plan.trainer_ranks, plan.world_size)}
    trainers, workers = await connect(store, plan, targets)
    try:
        received: list[SyncResult] = []

        async def receive(w: WorkerEngine) -> None:
            received.append(await w.receive())

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for w in workers:
                    tg.start_soon(receive, w)
                for e in trainers:
                    bad = sources(plan, e.rank, 1)
                    broken = BROKEN[fault](bad[name])
                    if broken is None:
                        del bad[name]
                    else:
                        bad[name] = broken
                    with pytest.raises(PlanError) as info:
                        await e.sync_weights(bad)
                    msg = str(info.value)
                    assert repr(name) in msg and f"rank {e.rank}" in msg, msg
                    assert e.state.value == "ready" and e.version == 0
                await anyio.sleep(0.05)
                assert received == []  # no round started: the workers still wait
                good = {e.rank: sources(plan, e.rank, 1) for e in trainers}
                res = await one_round(trainers, [], good)
        assert [r.round for r in received] == [1, 1] and res[0].round == 1
        for w in workers:
            assert w.state.value == "ready" and w.version == 1
            for n, want in expected(plan, w.rank, 1).items():
                assert same_bytes(targets[w.rank][n], want), n
    finally:
        await close(*trainers, *workers)


@pytest.mark.asyncio
async def test_specs_from_module_bf16_then_sync_the_fp32_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    specs = specs_from_module(model, dtype=torch.bfloat16)  # (1, 1) mesh: no process group
    assert {s.dtype for s in specs} == {"bfloat16"}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    store = MemoryStore()
    targets = {s.name: torch.zeros(s.shape, dtype=torch.bfloat16) for s in specs}

    async def trainer() -> Any:
        e = await TrainerEngine.connect(store=store.session(), rank=0, trainer_ranks=1,
                                        world_size=2, params=specs, config=CFG)
        try:
            return await e.sync_weights(model)
        finally:
            await e.close()

    async def worker() -> Any:
        e = await WorkerEngine.connect(store=store.session(), rank=1, trainer_ranks=1,
                                       world_size=2, mesh_dims=(1, 1), config=CFG,
                                       targets={n: (t, None) for n, t in targets.items()})
        try:
            return await e.receive()
        finally:
            await e.close()

    out: dict[str, Any] = {}

    async def run(key: str, fn: Any) -> None:
        out[key] = await fn()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "t", trainer)
            tg.start_soon(run, "w", worker)
    params = dict(model.named_parameters())
    for n, t in targets.items():
        assert same_bytes(t, params[n].detach().to(torch.bfloat16)), n
    assert out["t"].cast_bytes == out["t"].bytes == sum(s.nbytes for s in specs)
    assert out["w"].cast_bytes == 0


# Many small parameters of whole shards: once a trainer's fp32 (fp64) masters stay at the same
# addresses for a round, they are gathered by address and cast per group (``HostGather``
# with a cast); new objects go through the per-segment copies again, uncast rounds through
# the plain gather.
TINY_DEFS: list[ParamDef] = [(f"t{k}", ((8,), (2, 4), (3,))[k % 3], torch.bfloat16, None,
                              None) for k in range(120)]


@pytest.mark.asyncio
async def test_many_small_masters_cast_through_address_tables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from m2n_async._data._hostcopy import HostGather

    casting: list[HostGather] = []
    real = HostGather.run

    def spy(self: HostGather, buf: torch.Tensor) -> None:
        if any(g[4] is not None for g in self._groups):
            casting.append(self)
        real(self, buf)

    monkeypatch.setattr(HostGather, "run", spy)
    plan = make_plan(TINY_DEFS, (1, 2), (1, 2))
    store = MemoryStore()
    targets = {r: zeros(plan, r) for r in range(plan.trainer_ranks, plan.world_size)}
    trainers, workers = await connect(store, plan, targets)
    try:
        srcs: dict[int, dict[str, torch.Tensor]] = {}
        rounds = ["new", "in place", "in place", "new", "uncast", "new", "in place"]
        for version, how in enumerate(rounds, start=1):
            fresh = {e.rank: sources(plan, e.rank, version, cast=how != "uncast")
                     for e in trainers}
            if how == "in place":  # the same objects (and addresses), new values
                for r, got in fresh.items():
                    for n, t in got.items():
                        srcs[r][n].copy_(t)
            else:
                srcs = fresh
            before = len(casting)
            results = await one_round(trainers, workers, srcs)
            for w in workers:
                want = expected(plan, w.rank, version) if how != "uncast" else {
                    n: local_shard(full, plan.params[plan.index(n)].dst, w.rank)
                    for n, full in _wire_fulls(plan, version).items()}
                for n, t in targets[w.rank].items():
                    assert same_bytes(t, want[n]), (version, how, w.rank, n)
            for e in trainers:
                assert results[e.rank].cast_bytes == (
                    0 if how == "uncast" else cast_bytes_of(plan, e.rank, srcs[e.rank]))
            # the masters' second round at the same addresses onwards
            assert (len(casting) > before) == (version in (2, 3, 7)), (version, how)
    finally:
        await close(*trainers, *workers)
