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
The ranks run in a ``m2n_async.testing.LocalWorld``, the library's own harness: the store in a
thread of this process, one spawned process per rank, each rank function's return value (or
exception) back here for the checks. In a real job a launcher (torchrun, Ray) starts them.
Exits 0 when every shard is bit-exact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import TP_PLAN, Policy, boxed, digest, fail

from m2n_async import (
    EngineConfig,
    TrainerEngine,
    WorkerEngine,
    specs_from_module,
    targets_from_module,
)
from m2n_async.testing import LocalWorld, RankContext

CONFIG = EngineConfig(transport="gloo", bucket_bytes=16 << 10, round_timeout=60.0)
WIRE = torch.bfloat16  # the workers' dtype; the trainer's masters are fp32


# -- trainer ranks ---------------------------------------------------------------------------

async def trainer(ctx: RankContext, rendezvous: str) -> dict[str, Any] | None:
    """One FSDP2 step and one sync; trainer rank 0 returns what every worker must hold."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    # The trainer's own world: only the trainer ranks, its own rendezvous.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=ctx.rank,
                            world_size=ctx.trainer_ranks)
    try:
        torch.manual_seed(0)  # same initial weights on every trainer rank
        model = Policy()
        mesh = init_device_mesh("cpu", (ctx.trainer_ranks,))
        fully_shard(model, mesh=mesh)  # every parameter becomes a Shard(0) DTensor

        # One optimizer step on this rank's slice of a batch.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1 + ctx.rank)
        tokens = torch.randint(0, 64, (4, 8), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad()

        # fp32 masters, bf16 on the wire: the engine casts while packing.
        specs = specs_from_module(model, dtype=WIRE)
        engine = await TrainerEngine.connect(**ctx.connect_kwargs, params=specs, config=CONFIG)
        try:
            # The module itself: each local shard is looked up (to_local()) bucket by bucket.
            result = await engine.sync_weights(model)
            plan = engine.plan
        finally:
            await engine.close()

        # Expected bytes for every worker rank: its box (from the agreed plan's destination
        # layouts) of each updated full tensor.
        params = dict(model.named_parameters())
        expected: dict[int, dict[str, str]] = {}
        for p in plan.params:
            sharded = params[p.name]
            assert isinstance(sharded, DTensor)  # what fully_shard made every parameter
            full = sharded.full_tensor()  # a collective: same order on every rank
            assert full.dtype == torch.float32  # the masters stay fp32
            full = full.to(WIRE)  # what the workers must hold, bit for bit
            for w in p.dst.mesh.ranks:
                expected.setdefault(w, {})[p.name] = digest(
                    boxed(full, p.dst.box(p.spec.shape, w)))
        if ctx.rank != 0:
            return None
        return {"digests": expected, "version": result.version, "bytes": result.bytes,
                "loss": loss.item(), "cast_bytes": result.cast_bytes}
    finally:
        dist.destroy_process_group()


# -- worker ranks ----------------------------------------------------------------------------

async def worker(ctx: RankContext) -> dict[str, Any]:
    """Receive one version into zeroed bf16 TP shards; return their digests."""
    tp = ctx.world_size - ctx.trainer_ranks
    model = Policy(tp).to(WIRE)  # this TP rank's local shards, in the serving dtype
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # so that matching digests prove the bytes moved
    targets = targets_from_module(model, TP_PLAN)
    engine = await WorkerEngine.connect(**ctx.connect_kwargs, mesh_dims=(1, tp),
                                        targets=targets, config=CONFIG)
    try:
        result = await engine.receive()
    finally:
        await engine.close()
    got = {name: digest(tensor) for name, tensor in model.named_parameters()}
    return {"digests": got, "version": result.version, "bytes": result.bytes}


async def rank(ctx: RankContext, *, rendezvous: str) -> Any:
    """What every rank process runs: the first ``trainers`` ranks train, the others serve."""
    return await trainer(ctx, rendezvous) if ctx.is_trainer else await worker(ctx)


# -- the launcher and the checks -------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    # trainers + tp rank processes; leaving the block ends them.
    with tempfile.TemporaryDirectory() as tmp, \
            LocalWorld(trainers=args.trainers, workers=args.tp) as world:
        try:
            # After the first rank fails, the others get 10 s to end, then are killed.
            values = world.run(rank, kwargs={"rendezvous": str(Path(tmp) / "trainer-world")},
                               timeout=args.timeout, fail_grace=10.0).values
        except AssertionError as exc:  # a rank raised, died, or overran --timeout
            return fail(str(exc))
    expected, served = values[0], values[args.trainers:]
    checked = 0
    for w, got in enumerate(served, start=args.trainers):
        want = expected["digests"][w]
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
