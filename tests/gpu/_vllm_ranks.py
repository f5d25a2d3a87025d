"""Rank side of ``test_gpu_vllm``: the vLLM backend with every rank a process of its own.

Trainer ranks run ``VLLMTrainerEngine`` as a trainer's step loop does; worker ranks run a
``GPUWorker`` (vLLM 0.33's driving of the backend) over ``VLLMWorkerBackend`` and its model,
and answer the trainer's RPCs. Trainer rank 0's ``StoreRPCClient`` is the
``VLLMWeightSyncClient``: like Ray's client it calls every worker at once and returns when all
did, here through the test world's store (``rpc/<n>`` the call, ``rpc/<n>/done/<rank>`` each
worker's answer), so the worker's ``update_weights`` RPC is in flight while the trainers send,
as with a real vLLM server.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from integrations._vllm_world import SyncClient

from m2n_async.testing._gpu import RankCtx

T, TP = 2, 2
TOKEN = "vllm-gpu-tests"
IN_PLACE = {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"}
RPC_TIMEOUT = 240.0


class StoreRPCClient(SyncClient):
    """``VLLMWeightSyncClient`` of trainer rank 0 over the test store (module docstring).

    Called from the backend's threads (its RPC executor included); each call goes to the
    rank's event loop through ``portal``. A worker's exception comes back as a
    ``RuntimeError`` naming the worker rank and the method."""

    def __init__(self, ctx: RankCtx, portal: Any) -> None:
        super().__init__()
        self.ctx, self.portal = ctx, portal
        self.workers = list(range(ctx.trainer_ranks, ctx.world_size))
        self._n = 0

    def _all(self, method: str, *args: Any) -> None:
        self._n += 1
        self.portal.call(self._send, self._n, method, list(args))

    async def _send(self, n: int, method: str, args: list[Any]) -> None:
        import anyio

        store = self.ctx.store
        await store.set(f"rpc/{n}", json.dumps({"method": method, "args": args}).encode())
        with anyio.fail_after(RPC_TIMEOUT):
            await store.wait([f"rpc/{n}/done/{w}" for w in self.workers])
        for w in self.workers:
            answer = json.loads(await store.get(f"rpc/{n}/done/{w}") or b"{}")
            if "error" in answer:
                raise RuntimeError(f"worker rank {w}: {method}: {answer['error']}")

    def exit(self) -> None:
        """Not vLLM's: ends the worker ranks' RPC loops."""
        self._call("exit")


class _CudaSource:
    """The FSDP2-like source of the CPU tests, its local slabs on the trainer's GPU."""

    def __init__(self, inner: Any, device: Any) -> None:
        self.inner, self.device = inner, device

    @property
    def metadata(self) -> Any:
        return self.inner.metadata

    def owned_names(self, rank: int) -> list[str]:
        return list(self.inner.owned_names(rank))

    def iter_local(self) -> Iterator[tuple[str, Any]]:
        for name, t in self.inner.iter_local():
            yield name, t.to(self.device)


async def backend_rounds(ctx: RankCtx) -> dict[str, Any]:
    """``ctx.case``: ``transport``, ``store_port`` (the backend's store, served by trainer
    rank 0's engine), ``rounds``. Trainers return their results' versions and lanes; workers
    return the mismatches of every round (empty: bit-exact) and what the checks saw."""
    from integrations import _vllm_world as world

    from m2n_async.integrations import vllm as backend

    os.environ[backend.TOKEN_ENV] = TOKEN
    with world.stub_vllm():
        if ctx.rank < ctx.trainer_ranks:
            return await _trainer(ctx, world, backend)
        return await _worker(ctx, world, backend)


async def _trainer(ctx: RankCtx, world: Any, backend: Any) -> dict[str, Any]:
    import anyio
    import anyio.from_thread
    import anyio.to_thread

    case, rank = ctx.case, ctx.rank
    inner = world.ShardedSource(rank, ctx.trainer_ranks)
    source = _CudaSource(inner, ctx.device)
    out: dict[str, Any] = {"versions": [], "transports": []}
    async with anyio.from_thread.BlockingPortal() as portal:
        client = StoreRPCClient(ctx, portal) if rank == 0 else None
        info = backend.TrainerInitInfo(
            rank=rank, trainer_ranks=ctx.trainer_ranks, world_size=ctx.world_size,
            store_port=case["store_port"], job=f"vllm-gpu-{case['transport']}",
            dtype="bfloat16", transport=case["transport"], device=str(ctx.device),
            phase_timeout=60, round_timeout=60)
        engine = await anyio.to_thread.run_sync(
            lambda: backend.VLLMTrainerEngine.trainer_init(info, client=client,
                                                           source=source))
        try:
            for v in range(1, case["rounds"] + 1):
                inner.version = v
                await ctx.barrier(f"round-{v}")  # the workers have checked round v - 1
                result = await anyio.to_thread.run_sync(engine.send_weights, f"step-{v}")
                out["versions"].append(result.version)
                out["transports"].append(result.transport)
        finally:
            await anyio.to_thread.run_sync(engine.shutdown)
            if client is not None:
                await anyio.to_thread.run_sync(client.exit)
                out["calls"] = client.calls
    return out


async def _worker(ctx: RankCtx, world: Any, backend: Any) -> dict[str, Any]:
    import anyio
    import anyio.to_thread

    tp_rank = ctx.rank - ctx.trainer_ranks
    tp = ctx.world_size - ctx.trainer_ranks
    model = world.TinyLlama(tp_rank, tp).to(ctx.device)
    config = world.vllm_config(tp_rank, tp)
    engine = backend.VLLMWorkerBackend(object(), config, ctx.device, model)
    worker = world.GPUWorker(engine, tp_rank, config)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    out: dict[str, Any] = {"mismatches": [], "not_cuda": [], "rounds": 0}
    n = 0
    while True:
        n += 1
        with anyio.fail_after(RPC_TIMEOUT):
            call = json.loads(await ctx.store.get(f"rpc/{n}", wait=True) or b"{}")
        method = call["method"]
        if method == "exit":
            await ctx.store.set(f"rpc/{n}/done/{ctx.rank}", b"{}")
            break
        try:  # blocking, as inside vLLM's collective_rpc: off this loop
            await anyio.to_thread.run_sync(getattr(worker, method), *call["args"])
            answer: dict[str, Any] = {}
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        if method == "init_weight_transfer_engine" and "error" not in answer:
            out["transport"] = engine.engine.transport if engine.engine is not None else None
            out["loaded_names"] = sorted(engine.loaded_names)
        if method == "finish_weight_update" and "error" not in answer:
            out["rounds"] += 1
            _check(out, world, model, out["rounds"], tp_rank, tp)
        await ctx.store.set(f"rpc/{n}/done/{ctx.rank}", json.dumps(answer).encode())
        if method in ("init_weight_transfer_engine", "finish_weight_update") and \
                "error" not in answer and out["rounds"] < ctx.case["rounds"]:
            await ctx.barrier(f"round-{out['rounds'] + 1}")  # round v starts once checked
    out["in_place_kept"] = {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    out["load_calls"] = model.load_calls
    return out


def _check(out: dict[str, Any], world: Any, model: Any, version: int, tp_rank: int,
           tp: int) -> None:
    import torch

    got = dict(model.named_parameters())
    for name, want in world.expected_locals(version, tp_rank, tp).items():
        if not got[name].is_cuda:
            out["not_cuda"].append(name)
        if not torch.equal(got[name].detach().cpu(), want):
            out["mismatches"].append(f"round {version}: {name}")
