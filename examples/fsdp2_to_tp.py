"""FSDP2 trainer → tensor-parallel inference workers: one optimizer step, one sync, verified.

What it shows:

- the trainer is an ordinary FSDP2 job with a Gloo world of its own (``init_process_group``
  over its ranks only); ``m2n_async`` never touches that group;
- mixed precision: the trainer keeps fp32 master weights and the workers serve bf16.
  ``specs_from_module(model, dtype=torch.bfloat16)`` derives names, global shapes and layouts
  from the FSDP2 DTensors with bf16 on the wire, and ``sync_weights(model)`` takes the fp32
  module itself — each local shard (``to_local()``) is looked up lazily, bucket by bucket, and
  cast to bf16 while it is packed (no cast copy; ``SyncResult.cast_bytes`` counts it);
- the workers hold plain bf16 tensors already cut for TP=2 and declare them with
  ``targets_from_module(model, TP_PLAN)``;
- verification: every worker's received shard is compared, by SHA-256 of its bytes, with the
  box the agreed plan (``engine.plan``) assigns that worker in the trainer's updated full
  tensor (gathered with ``full_tensor()``) cast with ``.to(torch.bfloat16)``: the engine's
  cast must round exactly as torch does. Workers start from zeros, so a match proves the
  bytes moved.

Run: ``python examples/fsdp2_to_tp.py`` (CPU; ``--trainers``/``--tp`` to change the shape).
It starts a store in this process and the trainer and worker ranks as processes, and exits 0
when every shard is bit-exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
import torch
from _common import TP_PLAN, Policy, boxed, digest, fail, launch, new_token, write_json

from m2n_async import (
    EngineConfig,
    ParamSpec,
    StoreServer,
    SyncResult,
    TrainerEngine,
    TransferPlan,
    WorkerEngine,
    WorkerTargets,
    specs_from_module,
    targets_from_module,
)

CONFIG = EngineConfig(transport="gloo", bucket_bytes=16 << 10, round_timeout=60.0)
WIRE = torch.bfloat16  # the workers' dtype; the trainer's masters are fp32


# -- trainer ranks ---------------------------------------------------------------------------

def trainer(rank: int, trainers: int, tp: int, address: str, token: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The trainer's own world: only the trainer ranks, its own rendezvous.
    dist.init_process_group("gloo", init_method=f"file://{out / 'trainer-world'}",
                            rank=rank, world_size=trainers)
    try:
        torch.manual_seed(0)  # same initial weights on every trainer rank
        model = Policy()
        mesh = init_device_mesh("cpu", (trainers,))
        fully_shard(model, mesh=mesh)  # every parameter becomes a Shard(0) DTensor

        # One optimizer step on this rank's slice of a batch.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1 + rank)
        tokens = torch.randint(0, 64, (4, 8), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

        # fp32 masters, bf16 on the wire: the engine casts while packing.
        specs = specs_from_module(model, dtype=WIRE)
        result, plan = anyio.run(partial(_sync, rank, trainers, tp, address, token, specs,
                                         model))

        # Expected bytes for every worker rank: its box (from the agreed plan's destination
        # layouts) of each updated full tensor.
        params = dict(model.named_parameters())
        expected: dict[str, dict[str, str]] = {}
        for p in plan.params:
            full = params[p.name].full_tensor()  # a collective: same order on every rank
            assert full.dtype == torch.float32  # the masters stay fp32
            full = full.to(WIRE)  # what the workers must hold, bit for bit
            for w in p.dst.mesh.ranks:
                expected.setdefault(str(w), {})[p.name] = digest(
                    boxed(full, p.dst.box(p.spec.shape, w)))
        if rank == 0:
            write_json(out / "expected.json", {"digests": expected, "version": result.version,
                                              "bytes": result.bytes, "loss": loss.item(),
                                              "cast_bytes": result.cast_bytes})
    finally:
        dist.destroy_process_group()


async def _sync(rank: int, trainers: int, tp: int, address: str, token: str,
                specs: list[ParamSpec], model: torch.nn.Module
                ) -> tuple[SyncResult, TransferPlan]:
    engine = await TrainerEngine.connect(address, token=token, rank=rank,
                                         trainer_ranks=trainers, world_size=trainers + tp,
                                         params=specs, config=CONFIG)
    try:
        # The module itself: each local shard is looked up (to_local()) bucket by bucket.
        return await engine.sync_weights(model), engine.plan
    finally:
        await engine.close()


# -- worker ranks ----------------------------------------------------------------------------

def worker(index: int, trainers: int, tp: int, address: str, token: str, out: Path) -> None:
    model = Policy(tp).to(WIRE)  # this TP rank's local shards, in the serving dtype
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # so that matching digests prove the bytes moved
    targets = targets_from_module(model, TP_PLAN)
    result = anyio.run(partial(_receive, index, trainers, tp, address, token, targets))
    got = {name: digest(tensor) for name, (tensor, _placements) in targets.items()}
    write_json(out / f"worker{trainers + index}.json",
               {"digests": got, "version": result.version, "bytes": result.bytes})


async def _receive(index: int, trainers: int, tp: int, address: str, token: str,
                   targets: WorkerTargets) -> SyncResult:
    engine = await WorkerEngine.connect(address, token=token, rank=trainers + index,
                                        trainer_ranks=trainers, world_size=trainers + tp,
                                        mesh_dims=(1, tp), targets=targets, config=CONFIG)
    try:
        return await engine.receive()
    finally:
        await engine.close()


# -- the launcher ----------------------------------------------------------------------------

async def run(trainers: int, tp: int, out: Path, limit_s: float) -> dict[str, int]:
    token = new_token()
    async with StoreServer(host="127.0.0.1", port=0, token=token) as store:
        procs = {f"trainer{r}": (trainer, (r, trainers, tp, store.address, token, out))
                 for r in range(trainers)}
        procs |= {f"worker{trainers + i}": (worker, (i, trainers, tp, store.address, token, out))
                  for i in range(tp)}
        # launch() blocks on joins: run it off the loop so the store keeps serving.
        return await anyio.to_thread.run_sync(launch, procs, limit_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        codes = anyio.run(run, args.trainers, args.tp, out, args.timeout)
        if any(codes.values()):
            return fail(f"process exit codes {codes}")
        expected = json.loads((out / "expected.json").read_text())
        checked = 0
        for i in range(args.tp):
            w = args.trainers + i
            got = json.loads((out / f"worker{w}.json").read_text())
            want = expected["digests"][str(w)]
            if got["digests"] != want:
                bad = sorted(n for n in want if got["digests"].get(n) != want[n])
                return fail(f"worker rank {w}: shards differ from the trainer's: {bad}")
            if got["version"] != expected["version"]:
                return fail(f"worker rank {w} at version {got['version']}, trainer at "
                            f"{expected['version']}")
            checked += len(want)
    if expected["cast_bytes"] != expected["bytes"]:
        return fail(f"trainer rank 0 cast {expected['cast_bytes']} of {expected['bytes']} "
                    f"bytes; every fp32 master should have been cast to bf16")
    print(f"verified: {checked} shards on {args.tp} TP workers bit-exact after one FSDP2 step "
          f"on {args.trainers} trainers, fp32 masters cast to bf16 while packing (loss "
          f"{expected['loss']:.4f}, version {expected['version']}, {expected['bytes']} bytes "
          f"from trainer rank 0, all cast)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
