"""Per-rank scenarios the engine tests run inside pool processes (see ``_world``).

Each is a coroutine function taking keyword arguments (plus ``_events``/``_index`` from the
pool) and returning something small and picklable for the test to check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from m2n_async._data._native import NativeThread
from m2n_async._data._transport import Rendezvous, TransportContext, TransportSettings
from m2n_async._data.gloo import GlooTransport
from m2n_async._engine._pipeline import run_pipeline
from m2n_async._store import ControlGroup, StoreClient

from ._plans import ParamDef, empty_targets, expected_shards, make_plan, source_shards
from ._world import TOKEN


def _mismatches(plan: Any, rank: int, got: dict[str, torch.Tensor], version: int) -> list[str]:
    bad = []
    for name, want in expected_shards(plan, rank, version).items():
        g = got[name]
        if g.shape != want.shape or not torch.equal(g.reshape(-1).view(torch.uint8),
                                                    want.reshape(-1).view(torch.uint8)):
            bad.append(name)
    return bad


async def transport_rounds(*, address: str, job: str, rank: int, defs: Sequence[ParamDef],
                           src_dims: tuple[int, int], dst_dims: tuple[int, int],
                           bucket_bytes: int, max_inflight: int, versions: Sequence[int],
                           default_group: str | None = None, **_: Any) -> dict[str, Any]:
    """The Gloo transport + pipeline alone (no engine, no handshake): every version moves
    bit-exact; optionally a torch default process group works beside it."""
    plan = make_plan(defs, src_dims, dst_dims)
    world = plan.world_size
    if default_group is not None:
        torch.distributed.init_process_group("gloo", init_method=default_group, rank=rank,
                                             world_size=world)
    store = await StoreClient.connect(address, token=TOKEN)
    ns = f"{job}/1"
    group = ControlGroup(store, rank, world, ns)
    await group.join()
    native = NativeThread(f"test-r{rank}")
    settings = TransportSettings(max_inflight=max_inflight, host="127.0.0.1")
    ctx = TransportContext(plan, rank, 1, settings, native, plan.buckets(bucket_bytes), job)
    transport = GlooTransport(ctx)
    out: dict[str, Any] = {"bad": [], "bytes": [], "peak": [], "static": 0}
    try:
        await transport.prepare()
        watch = [group.alive_key(r) for r in range(world) if r != rank]
        await transport.connect(Rendezvous(store, f"{ns}/data/gloo/", rank=rank,
                                           world_size=world, timeout=30, watch=watch))
        for v in versions:
            transport.begin_round(v, time.monotonic() + 30)
            if rank < plan.trainer_ranks:
                shards = source_shards(plan, rank, v)

                async def src(bucket: Any, shards: Any = shards) -> Any:
                    return shards
                stats = await run_pipeline(transport, ctx.buckets, max_inflight=max_inflight,
                                           sources=src)
                assert stats.nbytes == plan.send_bytes(rank)
            else:
                targets = empty_targets(plan, rank)
                stats = await run_pipeline(transport, ctx.buckets, max_inflight=max_inflight,
                                           sinks=targets)
                assert stats.nbytes == plan.recv_bytes(rank)
                out["bad"] += _mismatches(plan, rank, targets, v)
            transport.end_round()
            out["bytes"].append(stats.nbytes)
            out["peak"].append(stats.peak_extra_bytes)
        out["static"] = transport.static_bytes
        out["arena"] = transport._arenas.size if transport._arenas else 0
        await group.barrier()
        if default_group is not None:
            x = torch.ones(3) * (rank + 1)
            torch.distributed.all_reduce(x)
            out["allreduce"] = x.tolist()
    finally:
        transport.abort("test teardown") if out.get("bad") else None
        await transport.close()
        native.close(5)
        if default_group is not None:
            torch.distributed.destroy_process_group()
        await store.aclose()
    return out


async def _all_connected(address: str, job: str, generation: int, rank: int,
                         world: int) -> None:
    """Wait until every rank's engine is connected. A victim killed while a peer is still
    inside Gloo's connectFullMesh makes that peer fail in connect, not in the round under
    test (seen once in CI: the survivor had no engine to report a version from)."""
    store = await StoreClient.connect(address, token=TOKEN)
    try:
        key = f"{job}/test-connected/{generation}/{{}}"
        await store.set(key.format(rank), b"1")
        with anyio.fail_after(60):
            await store.wait([key.format(r) for r in range(world)])
    finally:
        await store.aclose()


class _FreezeBeforeReport:
    """A store that blocks this process (then frozen by the test) just before it writes its
    round outcome: its part of the round is done, its report never comes."""

    def __init__(self, inner: Any, rank: int, events: Any) -> None:
        self._inner = inner
        self._rank = rank
        self._events = events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def compare_set(self, key: str, *args: Any, **kw: Any) -> Any:
        if key.endswith(f"/done/{self._rank}"):
            self._events.put(("ready_to_freeze", self._rank, time.time()))
            time.sleep(600)  # noqa: ASYNC251 - the whole process stops, as a frozen one does
        return await self._inner.compare_set(key, *args, **kw)


async def _store_up(address: str, limit: float = 30.0) -> None:
    """Wait until a store process (started beside the ranks) accepts connections."""
    with anyio.fail_after(limit):
        while True:
            try:
                client = await StoreClient.connect(address, token=TOKEN)
            except OSError:
                await anyio.sleep(0.05)
                continue
            except Exception as exc:  # a refused connection surfaces as StoreError
                if "refused" not in str(exc).lower() and "connect" not in str(exc).lower():
                    raise
                await anyio.sleep(0.05)
                continue
            await client.aclose()
            return


async def store_process(*, port: int, _events: Any = None, **_: Any) -> None:
    """A ``StoreServer`` as its own process (the test kills it): serves until killed."""
    from m2n_async._store import StoreServer

    async with StoreServer("127.0.0.1", port, token=TOKEN):
        _events.put(("store_ready", -1, time.time()))
        await anyio.sleep(600)


async def engine_rank(*, address: str, job: str, rank: int, defs: Sequence[ParamDef],
                      src_dims: tuple[int, int], dst_dims: tuple[int, int],
                      config: dict[str, Any], versions: Sequence[int],
                      load: Sequence[str] = (), victim: int | None = None,
                      leaver: int | None = None, freeze: int | None = None,
                      freeze_at: str = "mid", signal_in_round: bool = False,
                      wait_store: bool = False, _events: Any = None,
                      **_: Any) -> dict[str, Any]:
    """One rank of a TrainerEngine/WorkerEngine job over the TCP store.

    ``victim``: that rank blocks inside the first round (in its lazy source or load callback)
    after telling the test, which then kills it with SIGKILL. Survivors report what they
    raised and when (``time.time()``, comparable across processes on one host).
    ``leaver``: that rank closes its engine cleanly after the first version, as a rank whose
    program ends would, while the others go on to the next.
    ``freeze``: that rank blocks (and the test stops it with SIGSTOP) ``freeze_at``: "mid"
    (inside the first round, as ``victim``), "before_report" (its part of the first round
    done, before its outcome report) or "between" (after the first version, before the
    next round). ``signal_in_round``: trainer rank 0 tells the test once the first round is
    under way (and sleeps a second inside it), e.g. to kill the store then.
    ``wait_store``: the store is another process that may still be starting.
    """
    from m2n_async import EngineConfig, LoadTarget, TrainerEngine, WorkerEngine

    plan = make_plan(defs, src_dims, dst_dims)
    t, world = plan.trainer_ranks, plan.world_size
    cfg = EngineConfig(**config)
    out: dict[str, Any] = {"versions": [], "bad": [], "error": None, "loaded": [],
                           "cause": None}
    if freeze is not None:
        victim = None
    stuck = victim if victim is not None else (freeze if freeze_at == "mid" else None)

    def block_here() -> None:
        event = "ready_to_die" if victim is not None else "ready_to_freeze"
        _events.put((event, rank, time.time()))
        time.sleep(600)

    if wait_store:
        await _store_up(address)
    store: Any = None
    if freeze == rank and freeze_at == "before_report":
        store = _FreezeBeforeReport(await StoreClient.connect(address, token=TOKEN), rank,
                                    _events)
    where: dict[str, Any] = ({"store": store} if store is not None
                             else {"address": address, "token": TOKEN})

    engine: Any = None
    try:
        if rank < t:
            engine = await TrainerEngine.connect(rank=rank, trainer_ranks=t, world_size=world,
                                                 params=[p.spec for p in plan.params],
                                                 config=cfg, timeout=60, **where)
            out["generation"] = engine.generation
            if victim is not None or freeze is not None:
                await _all_connected(address, job, engine.generation, rank, world)
            for v in versions:
                if leaver == rank and out["versions"]:
                    break
                if freeze == rank and freeze_at == "between" and out["versions"]:
                    block_here()
                shards = source_shards(plan, rank, v)

                def lazy(names: list[str], shards: Any = shards) -> dict[str, torch.Tensor]:
                    if stuck == rank:
                        block_here()
                    if signal_in_round and rank == 0 and not out["versions"]:
                        _events.put(("in_round", rank, time.time()))
                        time.sleep(1.0)
                    return {n: shards[n] for n in names}
                res = await engine.sync_weights(lazy, version=v if rank == 0 else None)
                out["versions"].append(res.version)
                out["bytes"] = res.bytes
        else:
            targets: dict[str, Any] = {}
            sinks = empty_targets(plan, rank)
            for p in plan.params:
                name = p.spec.name
                if name in load:
                    def fn(n: str, x: torch.Tensor) -> None:
                        if stuck == rank:
                            block_here()
                        sinks[n].copy_(x)
                        out["loaded"].append(n)
                    targets[name] = LoadTarget(sinks[name].shape, sinks[name].dtype,
                                               p.dst.placements, fn)
                else:
                    targets[name] = (sinks[name], p.dst.placements)
            engine = await WorkerEngine.connect(rank=rank, trainer_ranks=t, world_size=world,
                                                targets=targets, mesh_dims=dst_dims,
                                                config=cfg, timeout=60, **where)
            out["generation"] = engine.generation
            if victim is not None or freeze is not None:
                await _all_connected(address, job, engine.generation, rank, world)
            for v in versions:
                if leaver == rank and out["versions"]:
                    break
                if freeze == rank and freeze_at == "between" and out["versions"]:
                    block_here()
                res = await engine.receive()
                out["versions"].append(res.version)
                out["bad"] += [f"v{v}:{n}" for n in _mismatches(plan, rank, sinks, v)]
                out["bytes"] = res.bytes
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc), getattr(exc, "rank", None),
                        time.time())
        out["cause"] = getattr(exc, "cause", None)
    finally:
        if engine is not None:
            out["version"] = engine.version
            await engine.close()
            out["state"] = engine.state.value
        if store is not None:
            await store.aclose()
    return out
