"""A local multi-process GPU world for ``tests/gpu`` and the GPU benches (``bench/gpu_*.py``):
the project's own GPU harness, in the package so that the benches import it like any module
(not part of the public toolkit: it drives transports below the engine).

The ranks are the processes of a ``LocalWorld`` (``m2n_async.testing``), fresh for each
``run_world``; several NCCL ranks share the one GPU (libnccl >= 2.30 with
``NCCL_MULTI_RANK_GPU_ENABLE=1``, DEVELOPERS "GPU tests on the H200"). By default trainer
rank 0 serves the scenario's ``StoreServer`` from its own event loop, as a job that hosts
the store in rank 0 does; ``case["store"] == "thread"`` serves it from a thread of rank 0
(``StoreServer.in_thread``, as the vLLM backend does), and ``"process"`` uses the world's
store instead, outside every rank (as ``m2n-async store`` beside a job). Every rank then uses
the real store, rendezvous, native thread, transports and bucket pipeline.

A *scenario* is a coroutine ``scenario(ctx) -> dict`` run on every rank (``ctx`` is a
``RankCtx``); its JSON-able result comes back to the parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOKEN = "m2n-gpu-test"
R = -1  # REPLICATE

# The CPU suite's layout pairs per topology: (src dims, dst dims, [(src pl, dst pl)]).
LAYOUTS: dict[str, tuple[tuple[int, int], tuple[int, int], list[tuple[Any, Any]]]] = {
    "1+1": ((1, 1), (1, 1), [(None, None)]),
    "2+2": ((1, 2), (1, 2), [((R, 0), (R, 1)), ((R, 1), (R, 1)), (None, (R, 0)),
                            ((R, 0), None), ((R, 0), (R, 0))]),
    "2+3": ((2, 1), (3, 1), [((0, R), (1, R)), ((0, R), None), (None, (1, R)),
                            ((1, R), (0, R))]),
}

M2N_DTYPES = ("bfloat16", "float32", "int8", "float8_e4m3fn")
NCCL_EXTRA_DTYPES = ("bool", "int16")


def layout_defs(topology: str, transport: str) -> list[tuple[str, tuple[int, ...], str, Any, Any]]:
    _src, _dst, pairs = LAYOUTS[topology]
    dtypes = M2N_DTYPES + (NCCL_EXTRA_DTYPES if transport == "nccl" else ())
    out: list[tuple[str, tuple[int, ...], str, Any, Any]] = []
    for k, (sp, dp) in enumerate(pairs):
        for j, dt in enumerate(dtypes):
            shape = (12, 6, 24) if j % 2 else (96, 48)
            out.append((f"l{k}.{dt}", shape, dt, sp, dp))
    return out


def coalesce_layout_defs(topology: str) -> list[tuple[str, tuple[int, ...], str, Any, Any]]:
    """The suite's layout pairs for the coalescing tests: every (pair, dtype) three times, the
    repeats far apart in the plan (stacking groups by geometry, not by neighbourhood), and a
    rank-3 tensor per pair (never stacked)."""
    _src, _dst, pairs = LAYOUTS[topology]
    out: list[tuple[str, tuple[int, ...], str, Any, Any]] = []
    for rep in range(3):
        for k, (sp, dp) in enumerate(pairs):
            out += [(f"r{rep}.l{k}.{dt}", (96, 48), dt, sp, dp) for dt in M2N_DTYPES]
            if rep == 1:
                out.append((f"r{rep}.l{k}.rank3", (12, 6, 24), "bfloat16", sp, dp))
    return out


#: ``mixed_defs`` arguments of a tiny mixed model for the GPU tests (seconds, not minutes).
TINY_MIXED: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2,
                              "head_dim": 16, "experts": 8, "moe_inter": 32, "vocab": 512,
                              "fused_experts": True}


def mixed_defs(*, layers: int = 4, hidden: int = 2048, heads: int = 32, kv_heads: int = 4,
               head_dim: int = 64, experts: int = 64, moe_inter: int = 256,
               vocab: int = 32768, dtype: str = "bfloat16", fused_experts: bool = False
               ) -> list[tuple[str, tuple[int, ...], str, Any, Any]]:
    """A scaled Qwen3-MoE-like stack in checkpoint order, as ``make_plan`` defs.

    Trainers: FSDP-like ``Shard(0)`` on mesh (1, T) for everything. Workers: vLLM-like TP on
    mesh (1, N): q/k/v, expert gate/up, embedding and lm_head ``Shard(0)`` (column parallel,
    vocab parallel); o and expert down ``Shard(1)`` (row parallel); layer norms, q/k norms and
    the router replicated. Every dim that is sharded is a multiple of 4, so T, N in {1, 2, 4}
    all divide. Shapes repeat across layers and experts (and k/v share the expert gate/up
    shape at the defaults): the geometry groups the ``m2n`` lane stacks.
    ``fused_experts`` adds per layer the rank-3 fused expert tensors vLLM keeps (``w13``
    (E, 2I, H) and ``w2`` (E, H, I)), which are never stacked.
    """
    row, col = (R, 0), (R, 1)
    q, kv = heads * head_dim, kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...], str, Any, Any]] = [
        ("model.embed_tokens.weight", (vocab, hidden), dtype, row, row)]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", (hidden,), dtype, row, None),
                (f"{p}.self_attn.q_proj.weight", (q, hidden), dtype, row, row),
                (f"{p}.self_attn.k_proj.weight", (kv, hidden), dtype, row, row),
                (f"{p}.self_attn.v_proj.weight", (kv, hidden), dtype, row, row),
                (f"{p}.self_attn.o_proj.weight", (hidden, q), dtype, row, col),
                (f"{p}.self_attn.q_norm.weight", (head_dim,), dtype, row, None),
                (f"{p}.self_attn.k_norm.weight", (head_dim,), dtype, row, None),
                (f"{p}.post_attention_layernorm.weight", (hidden,), dtype, row, None),
                (f"{p}.mlp.gate.weight", (experts, hidden), dtype, row, None)]
        for e in range(experts):
            x = f"{p}.mlp.experts.{e}"
            out += [(f"{x}.gate_proj.weight", (moe_inter, hidden), dtype, row, row),
                    (f"{x}.up_proj.weight", (moe_inter, hidden), dtype, row, row),
                    (f"{x}.down_proj.weight", (hidden, moe_inter), dtype, row, col)]
        if fused_experts:
            out += [(f"{p}.mlp.experts.w13_weight", (experts, 2 * moe_inter, hidden), dtype,
                     row, col),
                    (f"{p}.mlp.experts.w2_weight", (experts, hidden, moe_inter), dtype, row,
                     (R, 2))]
    out += [("model.norm.weight", (hidden,), dtype, row, None),
            ("lm_head.weight", (vocab, hidden), dtype, row, row)]
    return out


def make_plan(defs: Sequence[tuple[str, tuple[int, ...], str, Any, Any]],
              src_dims: tuple[int, int], dst_dims: tuple[int, int]) -> Any:
    from m2n_async._proto.layout import Layout, Mesh
    from m2n_async._proto.params import ParamSpec, ParamTransfer
    from m2n_async._proto.plan import TransferPlan

    t, n = src_dims[0] * src_dims[1], dst_dims[0] * dst_dims[1]
    smesh, dmesh = Mesh(src_dims, 0), Mesh(dst_dims, t)
    return TransferPlan([ParamTransfer(ParamSpec(name, dt, tuple(shape),
                                                 Layout(smesh, tuple(sp) if sp else None)),
                                       Layout(dmesh, tuple(dp) if dp else None))
                         for name, shape, dt, sp, dp in defs],
                        trainer_ranks=t, world_size=t + n)


def global_tensor(name: str, shape: tuple[int, ...], dtype_name: str, version: int,
                  device: Any) -> Any:
    """Random bytes seeded by (name, version), generated on ``device`` (finite floats)."""
    import torch

    dtype = getattr(torch, dtype_name)
    seed = (sum(name.encode()) * 7919 + len(name) * 104729 + version * 15485863) % (2**31)
    g = torch.Generator(device=device).manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)
    if dtype == torch.bool:
        raw = raw & 1
    elif dtype.is_floating_point and dtype.itemsize == 1:
        raw[(raw & 0x7F) >= 0x7C] = 0
    t = raw.view(dtype).reshape(shape)
    if dtype.is_floating_point and dtype.itemsize > 1:
        t = torch.where(t.float().isfinite(), t, torch.zeros((), dtype=dtype, device=device))
    return t.contiguous()


def local_shard(full: Any, layout: Any, rank: int) -> Any:
    box = layout.box(tuple(full.shape), rank)
    return full[tuple(slice(lo, hi) for lo, hi in box)].contiguous()


def source_shards(plan: Any, rank: int, version: int, device: Any,
                  dtype: str | None = None) -> dict[str, Any]:
    import torch

    out = {}
    for p in plan.params:
        s = p.spec
        t = local_shard(global_tensor(s.name, s.shape, s.dtype, version, device), s.layout, rank)
        out[s.name] = t if dtype is None else t.to(getattr(torch, dtype))
    return out


def expected_shards(plan: Any, rank: int, version: int, device: Any) -> dict[str, Any]:
    return {p.spec.name: local_shard(global_tensor(p.spec.name, p.spec.shape, p.spec.dtype,
                                                   version, device), p.dst, rank)
            for p in plan.params}


def back_to_back(tensors: Mapping[str, Any], groups: Any, device: Any) -> dict[str, Any]:
    """Copies of ``tensors`` as views of one buffer: the names of each group of ``groups``
    (sequences of names) back to back in that order, each group 256-byte aligned; names in no
    group keep their own tensor. A flat parameter buffer (Megatron's DDP keeps its parameters
    so), which lets the ``m2n`` lane reshard a stack in place."""
    import torch

    offsets: dict[str, int] = {}
    total = 0
    for group in groups:
        total = -(-total // 256) * 256
        for name in group:
            offsets[name] = total
            total += tensors[name].numel() * tensors[name].element_size()
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    out = dict(tensors)
    for name, off in offsets.items():
        t = tensors[name]
        view = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
    return out


def zero_targets(plan: Any, rank: int, device: Any) -> dict[str, Any]:
    import torch

    return {p.spec.name: torch.zeros(p.dst.local_shape(p.spec.shape, rank),
                                     dtype=getattr(torch, p.spec.dtype), device=device)
            for p in plan.params}


def mismatches(got: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    import torch

    bad = []
    for name, w in want.items():
        g = got[name]
        if not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            bad.append(name)
    return bad


@dataclass
class RankCtx:
    rank: int
    world_size: int
    trainer_ranks: int
    store: Any                  # StoreClient
    address: str
    case: dict[str, Any]
    device: Any

    async def barrier(self, name: str, limit: float = 60.0) -> None:
        import anyio

        with anyio.fail_after(limit):
            await self.store.set(f"barrier/{name}/{self.rank}", b"1")
            await self.store.gather(f"barrier/{name}/", self.world_size)


async def open_transport(ctx: RankCtx, name: str, plan: Any, *, bucket_bytes: int,
                         max_inflight: int, tag: str, max_cta: int | None = None,
                         coalesce: bool = True, coalesce_below: int | None = None) -> Any:
    """Create, prepare and connect transport ``name`` for ``plan`` (a new communicator).

    ``coalesce`` / ``coalesce_below`` go to ``TransportSettings`` (the ``m2n`` lane's stacked
    reshards; None keeps the settings' default threshold)."""
    from m2n_async._data._native import NativeThread
    from m2n_async._data._transport import (
        Rendezvous,
        TransportContext,
        TransportSettings,
        create_transport,
    )

    extra: dict[str, Any] = {"coalesce": coalesce}
    if coalesce_below is not None:
        extra["coalesce_below"] = coalesce_below
    settings = TransportSettings(max_inflight=max_inflight, max_cta=max_cta,
                                 device=str(ctx.device), **extra)
    native = NativeThread(f"{tag}-r{ctx.rank}")
    tctx = TransportContext(plan=plan, rank=ctx.rank, generation=1, settings=settings,
                            native=native, buckets=plan.buckets(bucket_bytes))
    t = create_transport(name, tctx)
    try:
        await t.prepare()
        await t.connect(Rendezvous(ctx.store, f"job/1/{tag}/", rank=ctx.rank,
                                   world_size=ctx.world_size, timeout=60.0))
    except BaseException:
        t.abort("setup failed")
        await t.close()
        native.close(2.0)
        raise
    return t


async def close_transport(t: Any) -> dict[str, Any]:
    import anyio

    t0 = time.monotonic()
    with anyio.CancelScope(shield=True):
        await t.close()
    joined = t.ctx.native.close(2.0)
    return {"close_s": round(time.monotonic() - t0, 3), "teardown_finished":
            bool(getattr(t, "teardown_finished", True)), "native_joined": joined}


async def run_round(t: Any, *, round: int, deadline_s: float, sources: Mapping[str, Any] | None,
                    sinks: Mapping[str, Any] | None) -> Any:
    """One round through the engine's bucket pipeline (pack ‖ transfer ‖ unpack)."""
    from m2n_async._engine._pipeline import run_pipeline

    t.begin_round(round, time.monotonic() + deadline_s)
    try:
        async def src(_bucket: Any) -> Mapping[str, Any]:
            assert sources is not None
            return sources

        return await run_pipeline(t, t.ctx.buckets, max_inflight=t.ctx.settings.max_inflight,
                                  sources=src if sources is not None else None, sinks=sinks)
    finally:
        t.end_round()


class LagMonitor:
    """Measures how late a 1 ms sleep on the event loop wakes up while work runs."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self.samples = 0

    async def run(self, stop: Any) -> None:
        import anyio

        while not stop.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            self.max_lag = max(self.max_lag, time.perf_counter() - t0 - 0.001)
            self.samples += 1


# -- process plumbing --------------------------------------------------------------------------

Scenario = Callable[[RankCtx], Awaitable[dict[str, Any]]]


def gpu_of(rank: int, trainer_ranks: int, world_size: int) -> int:
    """The GPU a rank runs on. One GPU: all ranks share it (libnccl >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1``). Several: trainers on the first half, workers on the
    second half (round-robin within each side), so every byte a worker receives crosses
    NVLink and "GB/s per receiving GPU" means what it says. ``M2N_TEST_GPUS=k`` uses only the
    first k visible GPUs."""
    import torch

    ngpu = torch.cuda.device_count()
    ngpu = min(ngpu, int(os.environ.get("M2N_TEST_GPUS", ngpu)) or ngpu)
    if ngpu <= 1:
        return 0
    side = ngpu // 2
    if rank < trainer_ranks:
        return rank % side
    return side + (rank - trainer_ranks) % (ngpu - side)


def _resolve(path: str) -> Scenario:
    import importlib

    module, _, attr = path.partition(":")
    fn: Scenario = getattr(importlib.import_module(module), attr)
    return fn


async def _gpu_rank(ctx: Any, *, scenario: str, case: dict[str, Any]) -> dict[str, Any]:
    """``LocalWorld`` rank function: the scenario on this rank's GPU, with the store the
    case asks for. Returns ``{"result": ..., "gpu": n}``, the result JSON-normalised (what a
    scenario returns must survive ``json``), or ``{"error", "traceback"}`` in ``result``."""
    import anyio
    import torch

    from m2n_async import StoreClient, StoreServer

    # Before this process's first NCCL call: NCCL reads its environment once per process.
    os.environ.update(case.get("env", {}))
    rank, world_size, trainer_ranks = ctx.rank, ctx.world_size, ctx.trainer_ranks
    gpu = gpu_of(rank, trainer_ranks, world_size)
    result: dict[str, Any]
    try:
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        fn = _resolve(scenario)
        world = await StoreClient.connect(ctx.address, token=TOKEN)
        try:
            if case.get("store") == "process":  # the world's store: outside every rank
                result = await _run_scenario(fn, ctx, case, device, ctx.address)
            elif rank == 0:  # served by trainer rank 0: its own event loop, or a thread
                async with contextlib.AsyncExitStack() as stack:
                    server = StoreServer(host="127.0.0.1", port=0, token=TOKEN)
                    if case.get("store") == "thread":
                        served = stack.enter_context(server.in_thread())
                        address = served.address
                    else:
                        address = (await stack.enter_async_context(server)).address
                    await world.set("gpu-world/store", address.encode())
                    result = await _run_scenario(fn, ctx, case, device, address)
                    # keep serving until every rank is done (a dead rank never is: bounded)
                    client = await StoreClient.connect(address, token=TOKEN)
                    with anyio.move_on_after(float(case.get("linger_s", 60))):
                        await client.wait([f"done/{r}" for r in range(world_size)
                                           if r not in case.get("victims", ())])
                    await client.aclose()
            else:
                with anyio.fail_after(120):
                    address = (await world.get("gpu-world/store", wait=True) or b"").decode()
                result = await _run_scenario(fn, ctx, case, device, address)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await world.aclose()
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    return {"result": json.loads(json.dumps(result, default=repr)), "gpu": gpu}


async def _run_scenario(fn: Scenario, ctx: Any, case: dict[str, Any], device: Any,
                        address: str) -> dict[str, Any]:
    import anyio

    from m2n_async import StoreClient

    store = await StoreClient.connect(address, token=TOKEN)
    rctx = RankCtx(ctx.rank, ctx.world_size, ctx.trainer_ranks, store, address, case, device)
    try:
        return await fn(rctx)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await store.set(f"done/{ctx.rank}", b"1")
            await store.aclose()


def run_world(scenario: str, case: dict[str, Any], *, trainer_ranks: int, world_size: int,
              timeout: float = 300.0) -> dict[str, Any]:
    """Run ``scenario`` ("module:function") on ``world_size`` fresh rank processes of a
    ``LocalWorld``; returns ``{"results": {rank: dict}, "gpus": {rank: n}, "exitcodes":
    [...], "seconds": s}``. A rank that raised reports ``{"error", "traceback"}``; one that
    died or did not report within ``timeout`` is missing from ``results`` (and killed).

    Fresh processes per call, ended when it returns: a rank whose communicator is wedged (a
    dead peer's M2N kernel) must not serve the next scenario; ``LocalWorld`` kills a process
    that does not end within its 5 s bound."""
    from m2n_async.testing._world import LocalWorld, WorldHangError

    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    env.update(case.get("env", {}))
    case = {**case, "env": env}  # set by each rank before its first NCCL call
    t0 = time.monotonic()
    with LocalWorld(trainer_ranks, world_size - trainer_ranks, token=TOKEN,
                    job_prefix="gpu") as world:
        try:
            ranks = list(world.run(_gpu_rank, kwargs={"scenario": scenario, "case": case},
                                   timeout=timeout))
        except WorldHangError as hang:
            ranks = list(hang.results)
    results: dict[int, dict[str, Any]] = {}
    gpus: dict[int, int] = {}
    for r in ranks:
        if r.status == "ok":
            results[r.rank], gpus[r.rank] = r.value["result"], r.value["gpu"]
        elif r.status == "error":  # raised outside the scenario's own guard
            results[r.rank] = {"error": f"{type(r.error).__name__}: {r.error}",
                               "traceback": r.traceback[-3000:]}
    return {"results": results, "gpus": gpus,
            "exitcodes": [r.exitcode if r.status != "ok" else 0 for r in ranks],
            "seconds": round(time.monotonic() - t0, 2)}
