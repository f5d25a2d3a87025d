"""Per-rank scenarios the engine tests run inside pool processes (see ``_world``).

Each is a coroutine function taking keyword arguments (plus ``_events``/``_index`` from the
pool) and returning something small and picklable for the test to check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

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
    settings = TransportSettings(bucket_bytes=bucket_bytes, max_inflight=max_inflight,
                                 host="127.0.0.1")
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
