"""An asynchronous RL loop: workers keep generating while the trainer trains and syncs.

What it shows:

- workers consume weight updates with ``async for update in engine.updates()`` in one task
  while another task keeps generating with the current weights — generation never waits for
  the trainer, only for the brief swap of a new version into the live model; the iteration
  ends by itself when the trainer closes the job;
- the update loop's body is that swap and nothing more: a worker takes part in a round only
  while the loop awaits the next one, so the trainer's next ``sync_weights`` waits for the
  body to finish (and a body longer than ``round_timeout`` fails the round, naming the
  worker); generation runs in its own task, not in the loop;
- every output is tagged with the weight **version** it was generated with (what an
  off-policy RL trainer needs to weigh or drop stale rollouts);
- double buffering: the engine writes into *shadow* tensors (declared with
  ``targets_from_module``) only while the update loop awaits the next round, so generation
  reading the live model never sees a half-written tensor; a committed update is copied
  into the live model under a lock;
- verification: the trainer records, per version, a digest of each worker's expected shards;
  every output's weights digest must equal the digest of the version it is tagged with;
- the generation task shares the worker's event loop with the engine, so its forward and
  digests run in a thread (torch and hashing release the GIL): each round's
  ``SyncResult.loop_stall_seconds`` says how long the loop was held up anyway, and the
  example prints the largest (``docs/troubleshooting.md``, "The event loop stalled").

In a real job the rollouts flow back to the trainer through the framework's data path; here
the trainer trains on synthetic batches so the example stays about the weight sync.

The ranks run in a ``m2n_async.testing.LocalWorld``, the library's own harness: the store in a
thread of this process, one spawned process per rank, each rank function's return value (or
exception) back here for the checks. In a real job a launcher (torchrun, Ray) starts them.

Run: ``python examples/async_rl.py`` (CPU; ``--steps``, ``--tp``). Exits 0 when verified.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from typing import Any

import anyio
import anyio.to_thread
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
PROMPT = torch.arange(8).reshape(1, 8)


def weights_digest(per_param: dict[str, str]) -> str:
    """One digest for a set of shards (name order fixed)."""
    text = "".join(f"{n}={per_param[n]};" for n in sorted(per_param))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# -- the trainer (one rank, a plain module) -----------------------------------------------


async def trainer(ctx: RankContext, steps: int) -> dict[int, dict[int, str]]:
    """Train ``steps`` steps, syncing after each; return, per version, the digest of what
    each worker rank must then hold."""
    torch.manual_seed(0)
    model = Policy()
    specs = specs_from_module(model)  # plain tensors: replicated on the one trainer rank
    expected: dict[int, dict[int, str]] = {}
    engine = await TrainerEngine.connect(**ctx.connect_kwargs, params=specs, config=CONFIG)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            tokens = torch.randint(0, 64, (4, 8), generator=gen)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                     tokens[:, 1:].flatten())
            torch.autograd.backward(loss)
            opt.step()
            opt.zero_grad()
            result = await engine.sync_weights(model)
            # What each worker rank now holds: its box (agreed plan) of every tensor.
            params = dict(model.named_parameters())
            expected[result.version] = {
                w: weights_digest({
                    p.name: digest(boxed(params[p.name], p.dst.box(p.spec.shape, w)))
                    for p in engine.plan.params})
                for w in range(ctx.trainer_ranks, ctx.world_size)}
    finally:
        await engine.close()
    return expected


# -- a worker (one TP rank) -----------------------------------------------------------------


async def worker(ctx: RankContext) -> dict[str, Any]:
    """Serve while updates arrive; return every output (version-tagged) and each round's
    event-loop stall."""
    tp = ctx.world_size - ctx.trainer_ranks
    live = Policy(tp).eval()    # what generation reads
    shadow = Policy(tp)         # what the engine writes, only inside the update loop
    targets = targets_from_module(shadow, TP_PLAN)
    outputs: list[dict[str, Any]] = []
    stalls: list[float] = []  # each round's SyncResult.loop_stall_seconds
    engine = await WorkerEngine.connect(**ctx.connect_kwargs, mesh_dims=(1, tp),
                                        targets=targets, config=CONFIG)
    lock = anyio.Lock()
    version = 0
    first, done = anyio.Event(), anyio.Event()

    def generate() -> dict[str, Any]:
        with torch.no_grad():
            tokens = live(PROMPT).argmax(-1).flatten().tolist()
        shards = {n: digest(t) for n, t in live.named_parameters()}
        return {"tokens": tokens, "weights": weights_digest(shards)}

    async def apply_updates() -> None:
        nonlocal version
        async for update in engine.updates():
            async with lock:  # swap: generation never reads a half-copied model
                with torch.no_grad():
                    for (_, dst), (_, src) in zip(live.named_parameters(),
                                                  shadow.named_parameters(), strict=True):
                        dst.copy_(src)
                version = update.version
            stalls.append(update.loop_stall_seconds)
            first.set()
        # The iteration ends when trainer rank 0 closes the job: no more versions.
        done.set()

    async def keep_generating() -> None:
        await first.wait()  # nothing to serve before the first weights arrive
        while not done.is_set():
            async with lock:
                tagged_version = version
                # the forward runs off the loop, so updates keep flowing meanwhile
                output = await anyio.to_thread.run_sync(generate)
            outputs.append({"version": tagged_version, **output})
            await anyio.sleep(0.005)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(apply_updates)
            tg.start_soon(keep_generating)
    finally:
        await engine.close()
    outputs.append({"version": version, **generate()})  # one at the final version
    return {"outputs": outputs, "stalls": stalls}


async def rank(ctx: RankContext, *, steps: int) -> Any:
    """What every rank process runs: rank 0 trains, the others serve."""
    return await trainer(ctx, steps) if ctx.is_trainer else await worker(ctx)


# -- the launcher and the checks -------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    # 1 trainer + tp worker processes; leaving the block ends them.
    with LocalWorld(trainers=1, workers=args.tp) as world:
        try:
            # After the first rank fails, the others get 10 s to end, then are killed.
            expected, *served = world.run(rank, kwargs={"steps": args.steps},
                                          timeout=args.timeout, fail_grace=10.0).values
        except AssertionError as exc:  # a rank raised, died, or overran --timeout
            return fail(str(exc))
    if sorted(expected) != list(range(1, args.steps + 1)):
        return fail(f"trainer committed versions {sorted(expected)}, expected 1..{args.steps}")
    per_worker = {}
    stalled = 0.0
    for w, got in enumerate(served, start=1):
        outputs = got["outputs"]
        versions = [o["version"] for o in outputs]
        if versions != sorted(versions) or versions[-1] != args.steps:
            return fail(f"worker rank {w}: versions out of order or short: {versions}")
        for n, o in enumerate(outputs):
            if o["weights"] != expected[o["version"]][w]:
                return fail(f"worker rank {w}, output #{n}: generated with weights that "
                            f"are not version {o['version']}'s")
        per_worker[w] = dict(sorted(Counter(versions).items()))
        stalled = max([stalled, *got["stalls"]])
    print(f"verified: {args.steps} versions synced to {args.tp} TP workers while they kept "
          f"generating; every output's weights match its version tag "
          f"(outputs per version, by worker rank: {per_worker})")
    # Not a check: how long generation beside the engine held up the workers' loops.
    print(f"the workers' event loops stalled at most {stalled * 1e3:.1f} ms in a round "
          f"(SyncResult.loop_stall_seconds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
