"""GPU sync benchmark: the engine's lanes vs raw per-parameter and raw stacked M2N, side by side.

One spawned world (``--trainers`` + ``--workers`` ranks, 2 + 2 by default) runs, on the same
tensors and in one process run, every path below; paths that share a communicator are
interleaved (A B C A B C ...). Layouts: ``moe``/``dense``/``large``: trainers ``Shard(0)`` on
mesh (1,T) -> workers ``Shard(1)`` on mesh (1,N); ``mixed``: a scaled Qwen3-MoE-like stack
(``m2n_async/testing/_gpu.mixed_defs``: FSDP-like ``Shard(0)`` trainers -> vLLM-like TP workers).
On one GPU every rank shares it (libnccl >= 2.30); on several, trainers take the first half of
the GPUs and workers the second half (``m2n_async/testing/_gpu.gpu_of``), and the summary adds GB/s
per receiving GPU and the efficiency against ``--link-gbps`` (370 GB/s, NVLink on H200).

* ``raw``            -- one ``nccl.m2n`` reshard per parameter, back to back on one stream, one
                        sync at the end (zero-copy buffers prepared up front);
* ``raw_stacked``    -- the same bytes as stacked reshards: per geometry group of the whole plan
                        (``_proto.stacking.bucket_calls`` over one plan-wide bucket), one reshard
                        of a preallocated ``(k, *shape)`` buffer on each side; parameters that
                        may not stack (rank 3, >= ``coalesce_below``) go single. The floor of
                        the coalescing lane;
* ``per_param``      -- vLLM-style: one reshard per parameter and a stream sync after each;
* ``m2n``            -- the ``m2n`` lane through the engine's bucket pipeline, coalescing on
                        (the settings' default: what ``transport="auto"`` runs on an M2N host);
* ``m2n_nocoalesce`` -- the same lane with ``coalesce=False``: one reshard per parameter;
* ``nccl``           -- the ``nccl`` lane (packed per-peer buffers, grouped send/recv);
* ``m2n_cast``       -- ``m2n`` (coalescing on) with fp32 master sources cast to the bf16 wire;
* ``pack_only``      -- the trainer's casts alone, per bucket one ``torch._foreach_copy_`` of
                        the fp32 shards into bf16 stacked staging (the lane's fallback when
                        Triton is absent; with it the lane runs ``pack_lane``'s kernel);
                        ``pack_per_tensor`` one ``.to(bf16)`` per shard (the old lane);
                        ``pack_flat`` one flat copy of the same bytes (the HBM floor);
* ``pack_lane``      -- the m2n lane's own ``stage`` of every bucket from the fp32 shards (its
                        stack arenas and cached views: what a round's pack costs), nothing sent;
* ``broadcast``      -- vLLM's packed broadcast (trainer rank 0 gathers full tensors and
                        broadcasts 64 MiB buckets; workers slice their shards). Default on for
                        ``moe`` and ``mixed`` (``--broadcast``/``--no-broadcast``);
* ``api_bf16`` / ``api_fp32`` -- the public API: ``TrainerEngine.connect`` /
                        ``WorkerEngine.connect`` over the store, ``sync_weights`` of bf16
                        shards and of fp32 master shards (cast to the bf16 wire), interleaved,
                        last in the run (``--no-api`` skips). If the engine refuses fp32
                        sources the refusal is reported and the bf16 figure stands alone.

Every section is guarded: a failing path is reported under ``path_errors`` (and in the GOAL
lines as n/a), the ranks agree on the outcome through the store, and the next section runs;
a section whose failure may have wedged a GPU context (an M2N abort that did not return)
ends the run early with what was measured.

``--threshold-sweep`` runs a different world: per per-rank size (64 KiB .. 64 MiB) it times
``count`` per-parameter reshards vs one stacked reshard of the same bytes (and the copies that
stacking costs), to find where one M2N call becomes bandwidth-bound
(``_proto.stacking.COALESCE_BELOW_BYTES`` claims >= 85 % at 16 MiB).

Each figure is the median over the timed iterations (after one warm-up) of the slowest rank's
wall time from a common store barrier to its own completion. On one GPU shared by all ranks
the absolute GB/s mean little (DEVELOPERS "GPU notes"); the ratios are the point. Buckets
default to 256 MiB (the GPU lanes' default ``bucket_bytes``).

    python bench/gpu_sync_bench.py --model mixed --out bench-gpu.jsonl
    python bench/gpu_sync_bench.py --model large --diagnose --broadcast
    python bench/gpu_sync_bench.py --threshold-sweep --out bench-gpu.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from m2n_async._data._transport import sink_map
from m2n_async.testing import _gpu as _world

Def = tuple[str, tuple[int, ...], str, Any, Any]

MODELS: dict[str, dict[str, Any]] = {
    # many small tensors (MoE experts): per-call overhead dominates
    "moe": {"n": 1024, "shape": (512, 256)},
    # a few large tensors
    "dense": {"n": 16, "shape": (4096, 4096)},
    # large tensors, 4 GiB in all: the NVLink-bandwidth figure
    "large": {"n": 32, "shape": (8192, 8192)},
    # a scaled Qwen3-MoE-like stack: 807 params, ~1.07 GiB bf16 (fp32 masters on trainers)
    "mixed": {"mixed": {"layers": 4, "hidden": 2048, "heads": 32, "kv_heads": 4,
                        "head_dim": 64, "experts": 64, "moe_inter": 256, "vocab": 32768}},
}

#: Models whose default comparison includes the packed broadcast (cheap enough there).
BROADCAST_BY_DEFAULT = ("moe", "mixed")

def _max_call_bytes() -> int:
    from m2n_async._proto import plan

    return int(getattr(plan, "M2N_MAX_CALL_BYTES", 2 << 30))


#: M2N's per-call limit the lane respects (the 2 GiB PACK bin per rank).
MAX_CALL_BYTES = _max_call_bytes()

#: Per-rank sizes of the threshold sweep (bytes).
#: The longest a rank waits after a timed call before the next barrier (``--settle``).
SETTLE_MAX_S = 0.25
THRESHOLD_SIZES = tuple(64 << 10 << (2 * k) for k in range(6))  # 64 KiB .. 64 MiB


def model_defs(model: str) -> list[Def]:
    m = MODELS[model]
    if "mixed" in m:
        return _world.mixed_defs(**m["mixed"])
    r = _world.R
    return [(f"layers.{i}.w", tuple(m["shape"]), "bfloat16", (r, 0), (r, 1))
            for i in range(m["n"])]


def model_plan(model: str, trainers: int, workers: int) -> Any:
    return _world.make_plan(model_defs(model), (1, trainers), (1, workers))


# -- pure helpers (no GPU: tested on CPU in tests/gpu/test_bench_summary.py) -------------------


def stack_groups(plan: Any, coalesce_below: int, max_call_bytes: int = MAX_CALL_BYTES
                 ) -> tuple[tuple[int, ...], ...]:
    """The calls of ``raw_stacked``: the lane's stacking rule over one bucket that spans the
    whole plan (every geometry group as few calls as the per-call limit allows)."""
    from m2n_async._proto.plan import Bucket
    from m2n_async._proto.stacking import bucket_calls

    n = len(plan.params)
    whole = Bucket(0, 0, n, sum(plan.param_cost(i) for i in range(n)))
    return bucket_calls(plan, whole, coalesce_below=coalesce_below,
                        max_call_bytes=max_call_bytes)


def lane_calls(plan: Any, bucket_bytes: int, coalesce_below: int | None,
               max_call_bytes: int = MAX_CALL_BYTES) -> list[tuple[tuple[int, ...], ...]]:
    """Per bucket, the calls the ``m2n`` lane issues (``coalesce_below`` None: coalescing
    off, one call per parameter)."""
    from m2n_async._proto.stacking import bucket_calls

    out = []
    for b in plan.buckets(bucket_bytes):
        if coalesce_below is None:
            out.append(tuple((i,) for i in range(b.start, b.stop)))
        else:
            out.append(bucket_calls(plan, b, coalesce_below=coalesce_below,
                                    max_call_bytes=max_call_bytes))
    return out


def m2n_side(m2n: Any, layout: Any, shape: tuple[int, ...], dtype: Any, buf: Any,
             stack: int | None = None) -> Any:
    """The ``DistTensor`` of one side of a reshard (``buf`` None: this rank is not on that
    side). ``stack``: the side of a stacked reshard of ``stack`` such tensors, shape
    ``(stack, *local)`` with every shard dim moved one to the right."""
    from m2n_async._proto.stacking import stacked_placement

    lay = layout.resolved()
    pl = lay.placements or (-1, -1)
    local = tuple(lay.shard_shape(tuple(shape)))
    if stack is not None:
        pl = tuple(stacked_placement(x) for x in pl)
        local = (stack, *local)
    return m2n.DistTensor(buf, local, dtype,
                          mesh=m2n.Mesh(tuple(lay.mesh.dims), lay.mesh.start_rank),
                          placements=tuple(m2n.Replicate() if x < 0 else m2n.Shard(x)
                                           for x in pl))


def raw_descriptors(m2n: Any, plan: Any, rank: int, sources: Mapping[str, Any] | None,
                    targets: Mapping[str, Any] | None,
                    groups: Sequence[tuple[int, ...]] | None = None
                    ) -> tuple[list[tuple[Any, Any]], list[tuple[tuple[int, ...], Any]]]:
    """(src, dst) descriptor pairs for ``raw`` (``groups`` None: one per parameter, zero-copy
    on the caller's tensors) or ``raw_stacked`` (one per group; a group of several gets a
    preallocated stacked buffer on each side: the trainer's filled from its shards). Returns
    the pairs and, per call, (plan indices, this rank's buffer) to check the result with."""
    import torch

    trainer = rank < plan.trainer_ranks
    calls = groups if groups is not None else tuple((i,) for i in range(len(plan.params)))
    descs: list[tuple[Any, Any]] = []
    bufs: list[tuple[tuple[int, ...], Any]] = []
    for idx in calls:
        p0 = plan.params[idx[0]]
        spec = p0.spec
        dtype = getattr(torch, spec.dtype)
        if len(idx) == 1:
            name = spec.name
            buf = sources[name] if trainer else targets[name]  # type: ignore[index]
            stack = None
        else:
            stack = len(idx)
            if trainer:
                assert sources is not None
                buf = torch.stack([sources[plan.params[i].spec.name] for i in idx])
            else:
                local = p0.dst.local_shape(tuple(spec.shape), rank)
                dev = next(iter(targets.values())).device  # type: ignore[union-attr]
                buf = torch.zeros((stack, *local), dtype=dtype, device=dev)
        src = m2n_side(m2n, spec.layout, spec.shape, dtype, buf if trainer else None, stack)
        dst = m2n_side(m2n, p0.dst, spec.shape, dtype, None if trainer else buf, stack)
        descs.append((src, dst))
        bufs.append((idx, buf))
    return descs, bufs


def stacked_mismatches(plan: Any, bufs: Sequence[tuple[tuple[int, ...], Any]],
                       want: Mapping[str, Any]) -> list[str]:
    """Worker: names whose bytes in the ``raw_stacked`` receive buffers differ from ``want``."""
    got: dict[str, Any] = {}
    for idx, buf in bufs:
        if len(idx) == 1:
            got[plan.params[idx[0]].spec.name] = buf
        else:
            for j, i in enumerate(idx):
                got[plan.params[i].spec.name] = buf[j]
    return _world.mismatches(got, want)


def pack_layout(plan: Any, rank: int, bucket_bytes: int, coalesce_below: int
                ) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Per bucket of the lane, per call: (plan indices, staging shape) of a trainer's cast
    staging: ``(k, *local)`` for a stacked call, ``local`` for a single parameter."""
    out = []
    for calls in lane_calls(plan, bucket_bytes, coalesce_below):
        row = []
        for idx in calls:
            s = plan.params[idx[0]].spec
            local = tuple(s.layout.local_shape(tuple(s.shape), rank))
            row.append((idx, (len(idx), *local) if len(idx) > 1 else local))
        out.append(row)
    return out


def pack_stacked(plan: Any, layout: Sequence[Sequence[tuple[tuple[int, ...], tuple[int, ...]]]],
                 sources: Mapping[str, Any], wire: Any, device: Any) -> list[Any]:
    """What the coalescing lane does to pack a trainer's fp32 shards: per bucket, staging of
    the wire dtype and ONE ``torch._foreach_copy_`` (the cast included) into it."""
    import torch

    keep = []
    for calls in layout:
        dsts, srcs = [], []
        for idx, shape in calls:
            buf = torch.empty(shape, dtype=wire, device=device)
            keep.append(buf)
            if len(idx) > 1:
                dsts.extend(buf.unbind(0))
            else:
                dsts.append(buf)
            srcs.extend(sources[plan.params[i].spec.name] for i in idx)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
    return keep


def bcast_sends(plan: Any) -> dict[int, list[tuple[int, Any]]]:
    """Packed broadcast, gather step: per trainer rank r > 0, the (param index, global box) it
    sends to rank 0, in order: every shard rank 0 lacks, from the first rank holding it."""
    out: dict[int, list[tuple[int, Any]]] = {r: [] for r in range(1, plan.trainer_ranks)}
    for i, p in enumerate(plan.params):
        lay, shape = p.spec.layout, tuple(p.spec.shape)
        mine = lay.shard_index(0)
        for s in range(lay.num_shards):
            if s != mine:
                out[lay.replicas(s)[0]].append((i, lay.shard_box(shape, s)))
    return out


def bcast_buckets(plan: Any, bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) runs of the plan whose full tensors fill one broadcast buffer (a param
    larger than the buffer goes alone)."""
    out, start, acc = [], 0, 0
    for i, p in enumerate(plan.params):
        if i > start and acc + p.spec.nbytes > bucket_bytes:
            out.append((start, i))
            start, acc = i, 0
        acc += p.spec.nbytes
    if plan.params:
        out.append((start, len(plan.params)))
    return out


def assemble_full(plan: Any, sources: Mapping[str, Any], received: Mapping[int, Any],
                  sends: Mapping[int, list[tuple[int, Any]]] | None = None) -> list[Any]:
    """Trainer rank 0: the full tensors, from its own shards and the flat buffers ``received``
    from each other trainer (laid out as ``bcast_sends`` says; pass ``sends`` to reuse it)."""
    import torch

    if sends is None:
        sends = bcast_sends(plan)
    full = []
    for p in plan.params:
        src = sources[p.spec.name]
        t = torch.empty(tuple(p.spec.shape), dtype=src.dtype, device=src.device)
        t[_slices(p.spec.layout.box(tuple(p.spec.shape), 0))] = src
        full.append(t)
    for r, flat in received.items():
        off = 0
        for i, box in sends[r]:
            shape = tuple(hi - lo for lo, hi in box)
            n = math.prod(shape)
            full[i][_slices(box)] = flat[off:off + n].view(shape)
            off += n
    return full


def kernel_variants() -> int | None:
    """How many forms of the Triton copy kernel this process has compiled (None without
    Triton): a form first needed in a round is compiled in that round."""
    from m2n_async._data import _kernels

    return _kernels.compiled_variants() if "compiled_variants" in dir(_kernels) else None


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def fp32_refusal(eng: Any, sources32: Mapping[str, Any], rank: int, device: str) -> str | None:
    """Would ``eng.sync_weights(sources32)`` refuse the fp32 shards before moving a byte? Checked
    with the engine's own source check, without starting a round: a round that fails on the
    trainers after the workers posted their M2N receives would leave those kernels waiting
    forever (DEVELOPERS "GPU notes": the abort does not return). None: accepted, or the
    check's internals moved (then the round itself decides)."""
    from m2n_async import M2NError

    try:
        from m2n_async._engine._engine import _Sources

        names = list(eng._names)
        check = _Sources(sources32, eng._plan, rank, device, eng._expect, names)
        check._check(0, names, sources32)
    except M2NError as exc:
        return f"{type(exc).__name__}: {exc}"[:400]
    except Exception:
        return None
    return None


# -- the per-rank run ------------------------------------------------------------------------


class _Sections:
    """Guarded sections: run one, catch its failure, then agree with every rank (through the
    store) on who failed. A rank that does not report within ``limit`` (stuck on the GPU), or a
    transport whose abort did not return, abandons the rest of the run on every rank that
    still can: the ranks report what they measured instead of hanging."""

    def __init__(self, ctx: _world.RankCtx, out: dict[str, Any], limit: float) -> None:
        self.ctx, self.out, self.limit = ctx, out, limit
        self.abandoned: str | None = None
        self.wedged = False
        self.errors: dict[str, str] = out.setdefault("errors", {})

    async def run(self, name: str, fn: Callable[[], Awaitable[Any]]) -> bool:
        import anyio

        if self.abandoned is not None:
            self.errors[name] = f"skipped: {self.abandoned}"
            return False
        err = None
        try:
            await fn()
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"[:600]
            self.out.setdefault("tracebacks", {})[name] = traceback.format_exc()[-2000:]
        ctx = self.ctx
        mine = json.dumps({"err": err, "wedged": self.wedged}).encode()
        try:
            with anyio.fail_after(self.limit):
                await ctx.store.set(f"section/{name}/{ctx.rank:04d}", mine)
                got = await ctx.store.gather(f"section/{name}/", ctx.world_size)
        except Exception as exc:
            self.abandoned = f"ranks lost step after {name!r} ({type(exc).__name__})"
            self.errors[name] = err or self.abandoned
            return False
        votes = [json.loads(v) for _k, v in sorted(got.items())]
        failed = [r for r, v in enumerate(votes) if v["err"]]
        if any(v["wedged"] for v in votes):
            self.abandoned = f"a GPU transport abort did not return during {name!r}"
        if failed:
            self.errors[name] = err or f"failed on ranks {failed}"
            return False
        return True


async def bench_rank(ctx: _world.RankCtx) -> dict[str, Any]:
    import anyio
    import torch

    case = ctx.case
    t_ranks, n_ranks = ctx.trainer_ranks, ctx.world_size - ctx.trainer_ranks
    plan = model_plan(case["model"], t_ranks, n_ranks)
    trainer = ctx.rank < t_ranks
    dev = ctx.device
    iters, slow = case["iters"], case["slow_iters"]
    settle = float(case.get("settle", 0.0))
    below = case["coalesce_below"]
    deadline = float(case["round_deadline"])
    sources = _world.source_shards(plan, ctx.rank, 0, dev) if trainer else None
    targets = None if trainer else _world.zero_targets(plan, ctx.rank, dev)
    if case.get("one_buffer"):
        # views of one buffer, each of the lane's stacks back to back: it reshards them in
        # place (``M2NTransport._span``), as on a flat parameter buffer
        order = [[plan.params[i].spec.name for i in call]
                 for calls in lane_calls(plan, case["bucket_bytes"], below) for call in calls]
        if sources is not None:
            sources = _world.back_to_back(sources, order, dev)
        if targets is not None:
            targets = _world.back_to_back(targets, order, dev)
    sources32 = ({k: v.float() for k, v in sources.items()} if sources is not None else None)
    # As the engine does at connect: the targets as Sink records once, not every round (a
    # plain mapping costs the lane a conversion per round, ~1 µs a target on its stage path).
    sinks = sink_map(targets) if targets is not None else None
    want = None if trainer else _world.expected_shards(plan, ctx.rank, 0, dev)
    groups = stack_groups(plan, below)
    out: dict[str, Any] = {
        "bytes": plan.send_bytes(ctx.rank) if trainer else plan.recv_bytes(ctx.rank),
        "gpu": dev.index, "gpu_name": torch.cuda.get_device_name(dev),
        "params": len(plan.params),
        "calls": {"raw": len(plan.params), "raw_stacked": len(groups),
                  "m2n (predicted)": sum(map(len, lane_calls(plan, case["bucket_bytes"],
                                                             below))),
                  "m2n_nocoalesce": len(plan.params)},
        "buckets": len(plan.buckets(case["bucket_bytes"]))}
    sec = _Sections(ctx, out, limit=deadline + 120.0)
    seq = [0]

    def zero() -> None:
        if targets is not None:
            for v in targets.values():
                v.zero_()

    def check(tag: str) -> None:
        if want is not None and targets is not None:
            out[f"bad_{tag}"] = _world.mismatches(targets, want)[:20]

    async def timed_interleaved(paths: dict[str, Callable[[], Awaitable[Any]]],
                                n: Mapping[str, int] | int | None = None) -> None:
        # A B C A B C ...: on the x2 host the per-call cost of M2N drifted between paths run
        # one after another (MoE 1+1: raw 49 ms first, the same raw calls 78-80 ms later), so
        # the headline ratios come from paths that share every iteration's conditions
        seq[0] += 1
        counts = {k: (n[k] if isinstance(n, Mapping) else iters if n is None else n)
                  for k in paths}
        times: dict[str, list[float]] = {k: [] for k in paths}
        for it in range(max(counts.values()) + 1):
            for name, fn in paths.items():
                if it > counts[name]:
                    continue
                await ctx.barrier(f"{seq[0]}-{name}-{it}", limit=deadline + 60.0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await fn()
                elapsed = time.perf_counter() - t0
                times[name].append(elapsed)
                if settle:
                    # a rank done early would otherwise send its next barrier to the store
                    # while the slowest rank still finishes: in rank 0's loop, serving it
                    # delays rank 0's own completion hand-off, and only on paths whose end
                    # goes through the loop (the lane's) -- not a cost of the path timed
                    await anyio.sleep(min(SETTLE_MAX_S, settle * elapsed))
        for name, ts in times.items():
            out[name] = ts[1:]
            out.setdefault("first_s", {})[name] = ts[0]  # dropped above: warm-up, compiles

    async def timed(name: str, fn: Any, n: int | None = None) -> None:
        await timed_interleaved({name: fn}, n)

    rnd = [0]

    async def pipeline(tr: Any, srcs: Any) -> None:
        rnd[0] += 1
        await _world.run_round(tr, round=rnd[0], deadline_s=deadline, sources=srcs,
                               sinks=sinks)
        if trainer:
            # trainer ends when its sends were handed over; match the raw path's full sync
            torch.cuda.synchronize()

    async def close(tr: Any, tag: str) -> None:
        info = await _world.close_transport(tr)
        out.update({f"{tag}_{k}": v for k, v in info.items()})
        if not info["teardown_finished"]:
            sec.wedged = True

    async def opened(tag: str, name: str = "m2n", **kw: Any) -> Any:
        kw.setdefault("bucket_bytes", case["bucket_bytes"])
        kw.setdefault("max_inflight", case["max_inflight"])
        return await _world.open_transport(ctx, name, plan, tag=f"bench-{tag}", **kw)

    # -- the casts alone (no communicator) --------------------------------------------------
    async def s_pack() -> None:
        layout = pack_layout(plan, ctx.rank, case["bucket_bytes"], below) if trainer else []
        flat32 = flat16 = None
        if sources32 is not None:
            flat32 = torch.cat([v.reshape(-1) for v in sources32.values()])
            flat16 = torch.empty(flat32.numel(), dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream()

        async def pack_only() -> None:
            if sources32 is not None:
                with torch.cuda.stream(side):
                    keep = pack_stacked(plan, layout, sources32, torch.bfloat16, dev)
                side.synchronize()
                del keep

        async def pack_per_tensor() -> None:
            if sources32 is not None:
                with torch.cuda.stream(side):
                    keep = [v.to(torch.bfloat16) for v in sources32.values()]
                side.synchronize()
                del keep

        async def pack_flat() -> None:
            if flat16 is not None:
                with torch.cuda.stream(side):
                    flat16.copy_(flat32)
                side.synchronize()

        await timed_interleaved({"pack_only": pack_only, "pack_per_tensor": pack_per_tensor,
                                 "pack_flat": pack_flat})

    await sec.run("pack", s_pack)

    # -- the m2n lane (coalescing on) interleaved with raw and raw stacked M2N ---------------
    stream = torch.cuda.Stream()

    def raw_calls(t: Any, descs: Any, sync_each: bool, s: Any = stream) -> None:
        sptr = s.cuda_stream
        for src, dst in descs:
            t.handle.reshard(t.comm, src, dst, stream=sptr)
            if sync_each:
                s.synchronize()
        s.synchronize()

    def raw_paths(t: Any) -> tuple[dict[str, Any], Any, Any]:
        from m2n_async._data._cuda import m2n_module

        m2n = m2n_module()
        descs, _ = raw_descriptors(m2n, plan, ctx.rank, sources, targets)
        sdescs, sbufs = raw_descriptors(m2n, plan, ctx.rank, sources, targets, groups)

        async def raw() -> None:
            await t.ctx.native.run(raw_calls, t, descs, False)

        async def raw_stacked() -> None:
            await t.ctx.native.run(raw_calls, t, sdescs, False)

        async def per_param() -> None:
            await t.ctx.native.run(raw_calls, t, descs, True)

        return {"raw": raw, "raw_stacked": raw_stacked, "per_param": per_param}, sbufs, descs

    def check_stacked(sbufs: Any) -> None:
        if want is not None:
            out["bad_raw_stacked"] = stacked_mismatches(plan, sbufs, want)[:20]

    interleaved_raw = [False]

    async def s_m2n() -> None:
        t = await opened("m2n", coalesce=True, coalesce_below=below, max_cta=case.get("max_cta"))
        try:
            out["grouping"] = t.grouping_reason
            out["kernel_variants"] = {"connected": kernel_variants()}
            paths, sbufs, descs = raw_paths(t)
            await timed_interleaved({**paths, "m2n": lambda: pipeline(t, sources)},
                                    {"raw": slow, "per_param": slow, "raw_stacked": iters,
                                     "m2n": iters})
            interleaved_raw[0] = True
            out["kernel_variants"]["after_rounds"] = kernel_variants()
            check_stacked(sbufs)
            zero()
            await paths["raw"]()
            check("raw")
            zero()
            await pipeline(t, sources)
            check("m2n")
            zero()
            await timed("m2n_cast", lambda: pipeline(t, sources32))
            check("m2n_cast")
            if groups and len(groups) < len(plan.params):
                # the headline pair again, without the per-parameter paths between them (the
                # 1024-call raw paths run in the first iterations of the interleave above), then
                # each path back to back on its own: what the order of paths costs the ratio
                await timed_interleaved({"raw_stacked_pair": paths["raw_stacked"],
                                         "m2n_pair": lambda: pipeline(t, sources)})
                await timed("raw_stacked_alone", paths["raw_stacked"])
                await timed("m2n_alone", lambda: pipeline(t, sources))
                check("m2n_alone")

            async def pack_lane() -> None:
                # the lane's own trainer pack (its arenas and cached views), nothing sent
                if trainer:
                    for b in t.ctx.buckets:
                        st = await t.stage(b, sources=sources32)
                        t.streams.pack.synchronize()
                        t.release(st)

            await timed("pack_lane", pack_lane)
            if case.get("diagnose"):
                await diagnose(t, descs)
            if case.get("timeline"):
                await ctx.barrier("timeline-m2n")
                out["timeline_m2n"] = await traced_round(t, sources, pipeline)
        finally:
            await close(t, "m2n")

    async def diagnose(t: Any, descs: Any) -> None:
        async def raw_tstream() -> None:
            await t.ctx.native.run(raw_calls, t, descs, False, t.streams.transfer)

        def raw_after_default() -> None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            stream.wait_event(ev)
            raw_calls(t, descs, False)

        async def raw_default_dep() -> None:
            await t.ctx.native.run(raw_after_default)

        def raw_build() -> None:
            # like ``raw`` but building the descriptors per call, as a lane without reuse does
            from m2n_async._data._cuda import m2n_module

            d, _ = raw_descriptors(m2n_module(), plan, ctx.rank, sources, targets)
            raw_calls(t, d, False)

        async def raw_built() -> None:
            await t.ctx.native.run(raw_build)

        await timed("raw_after_default_stream_event", raw_default_dep, slow)
        await timed("raw_transfer_stream", raw_tstream, slow)
        await timed("raw_build_descs", raw_built, slow)
        # one traced pipeline round: per bucket, enqueue time and time until it completed
        trace: list[dict[str, float]] = []
        orig = t.transfer

        def traced(st: Any) -> Any:
            t_sub = time.perf_counter()
            c = orig(st)
            rec = {"bucket": st.bucket.index, "params": st.bucket.stop - st.bucket.start,
                   "submit": t_sub}
            trace.append(rec)
            c.signal.add_done_callback(lambda _s: rec.__setitem__("done", time.perf_counter()))
            return c

        t.transfer = traced
        await ctx.barrier("trace")
        t_start = time.perf_counter()
        try:
            await pipeline(t, sources)
        finally:
            del t.transfer  # back to the class method
        out["trace"] = [{k: (round(v - t_start, 4) if k in ("submit", "done") else v)
                         for k, v in r.items()} for r in trace]
        from m2n_async._data import m2n as m2n_plane

        if hasattr(m2n_plane, "GATE_BYTES"):
            # the same casts with one fence per bucket: every reshard waits for all casts
            saved_gate = m2n_plane.GATE_BYTES
            m2n_plane.GATE_BYTES = 1 << 62
            try:
                await timed("m2n_cast_one_fence", lambda: pipeline(t, sources32))
            finally:
                m2n_plane.GATE_BYTES = saved_gate

    ok = await sec.run("m2n", s_m2n)
    if not ok and not interleaved_raw[0]:
        # the lane failed before the raw figures were in: measure them on a fresh communicator
        async def s_raw() -> None:
            t = await opened("raw", max_cta=case.get("max_cta"))
            try:
                paths, sbufs, _ = raw_paths(t)
                await timed_interleaved(paths, {"raw": slow, "per_param": slow,
                                                "raw_stacked": iters})
                check_stacked(sbufs)
            finally:
                await close(t, "raw")

        await sec.run("raw_retry", s_raw)

    # -- the m2n lane, coalescing off (one reshard per parameter) ----------------------------
    async def s_nocoalesce() -> None:
        t = await opened("m2n-nocoalesce", coalesce=False, max_cta=case.get("max_cta"))
        try:
            zero()
            await timed("m2n_nocoalesce", lambda: pipeline(t, sources), slow)
            check("m2n_nocoalesce")
        finally:
            await close(t, "m2n_nocoalesce")

    await sec.run("m2n_nocoalesce", s_nocoalesce)

    if case.get("diagnose"):
        for tag, env, bb, mi in (
                ("m2n_blocking_events", {"M2N_ASYNC_CUDA_EVENT": "blocking",
                                         "M2N_ASYNC_CUDA_COMPLETION": "watch"}, None, None),
                ("m2n_poll_events", {"M2N_ASYNC_CUDA_COMPLETION": "poll"}, None, None),
                ("m2n_bucket_64MiB", {}, 64 << 20, None),
                ("m2n_bucket_1GiB", {}, 1 << 30, None),
                ("m2n_one_bucket", {}, 1 << 40, 1)):
            async def s_variant(tag: str = tag, env: dict[str, str] = env, bb: Any = bb,
                                mi: Any = mi) -> None:
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    tv = await opened(tag, bucket_bytes=bb or case["bucket_bytes"],
                                      max_inflight=mi or case["max_inflight"],
                                      coalesce_below=below)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                try:
                    await timed(tag, lambda: pipeline(tv, sources))
                finally:
                    await close(tv, tag)

            await sec.run(tag, s_variant)

    # -- the nccl lane -----------------------------------------------------------------------
    async def s_nccl() -> None:
        tn = await opened("nccl", "nccl")
        try:
            zero()
            await timed("nccl", lambda: pipeline(tn, sources))
            check("nccl")
            if case.get("timeline"):
                await ctx.barrier("timeline-nccl")
                out["timeline_nccl"] = await traced_round(tn, sources, pipeline)
        finally:
            await close(tn, "nccl")

    await sec.run("nccl", s_nccl)

    # -- vLLM's packed broadcast --------------------------------------------------------------
    if case.get("broadcast"):
        async def s_bcast() -> None:
            out.update(await broadcast_baseline(ctx, plan, sources, targets, want, timed,
                                                close))

        await sec.run("broadcast", s_bcast)

    # -- bucket_bytes x max_inflight x max_cta sweep of the m2n lane ------------------------
    for k, (bb, mi, cta) in enumerate(case.get("sweep", [])):
        async def s_sweep(k: int = k, bb: int = bb, mi: int = mi, cta: Any = cta) -> None:
            ts = await opened(f"sweep-{k}", bucket_bytes=bb, max_inflight=mi, max_cta=cta,
                              coalesce_below=below)
            try:
                out[f"sweep_{k}_config"] = {"bucket_bytes": bb, "max_inflight": mi,
                                            "max_cta": cta, "buckets": len(ts.ctx.buckets)}
                await timed(f"sweep_{k}", lambda: pipeline(ts, sources), n=1)
            finally:
                await close(ts, f"sweep_{k}")

        await sec.run(f"sweep_{k}", s_sweep)

    # -- the public API, bf16 and fp32 sources (last: see fp32_refusal) ----------------------
    if case.get("api"):
        await api_paths(ctx, case, plan, sources, sources32, targets, sec, out,
                        timed_interleaved, zero, check)
    out["abandoned"] = sec.abandoned
    return out


async def api_paths(ctx: _world.RankCtx, case: dict[str, Any], plan: Any, sources: Any,
                    sources32: Any, targets: Any, sec: _Sections, out: dict[str, Any],
                    timed_interleaved: Any, zero: Any, check: Any) -> None:
    """``TrainerEngine``/``WorkerEngine`` over the store: ``sync_weights`` of bf16 shards, then
    (if the engine takes them) of fp32 master shards, interleaved with bf16."""
    import anyio

    import m2n_async

    trainer = ctx.rank < ctx.trainer_ranks
    deadline = float(case["round_deadline"])
    if case.get("api_marks"):
        import api_marks  # bench/, beside this script

        api_marks.install(case["api_marks"])
    cfg = m2n_async.EngineConfig(
        transport=case["api_transport"], bucket_bytes=case["bucket_bytes"],
        max_inflight=case["max_inflight"], max_cta=case.get("max_cta"), device=str(ctx.device),
        phase_timeout=120.0, round_timeout=deadline, job="bench-api", coalesce=True,
        coalesce_below=case["coalesce_below"])
    eng: list[Any] = [None]
    last: dict[str, Any] = {}

    async def s_connect() -> None:
        kw = {"token": _world.TOKEN, "rank": ctx.rank, "trainer_ranks": ctx.trainer_ranks,
              "world_size": ctx.world_size, "config": cfg}
        if trainer:
            eng[0] = await m2n_async.TrainerEngine.connect(
                ctx.address, params=[p.spec for p in plan.params], **kw)
        else:
            spec = {p.spec.name: (targets[p.spec.name], p.dst.placements) for p in plan.params}
            eng[0] = await m2n_async.WorkerEngine.connect(
                ctx.address, targets=spec, mesh_dims=tuple(plan.params[0].dst.mesh.dims), **kw)

    def sync(tag: str, srcs: Any) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            if case.get("api_marks"):
                import api_marks

                api_marks.set_tag(tag)
            if trainer:
                res = await eng[0].sync_weights(srcs)
            else:
                res = await eng[0].receive(timeout=deadline)
            last[tag] = {"transport": res.transport, "reason": res.reason[:300],
                         "seconds": round(res.seconds, 5), "buckets": res.buckets,
                         "peak_extra_bytes": res.peak_extra_bytes,
                         # newer SyncResult fields, where this engine has them
                         "predicted_seconds": getattr(res, "predicted_seconds", None),
                         "cast_bytes": getattr(res, "cast_bytes", None),
                         "phases": {k: round(v, 5) for k, v in res.phases.items()}}
        return run

    bf16, fp32 = sync("api_bf16", sources), sync("api_fp32", sources32)

    async def s_bf16() -> None:
        zero()
        await timed_interleaved({"api_bf16": bf16})
        check("api_bf16")

    async def s_fp32() -> None:
        refusal = (fp32_refusal(eng[0], sources32, ctx.rank, str(ctx.device))
                   if trainer else None)
        with anyio.fail_after(60):
            await ctx.store.set(f"api-fp32/{ctx.rank:04d}", (refusal or "").encode())
            got = await ctx.store.gather("api-fp32/", ctx.world_size)
        refused = {k: v.decode() for k, v in sorted(got.items()) if v}
        if refused:
            # every rank raises the same: the section fails, the bf16 figure stands
            raise RuntimeError(f"the engine refuses fp32 sources (checked before the round): "
                               f"{next(iter(refused.values()))}")
        zero()
        await fp32()
        check("api_fp32")
        saved = out.get("api_bf16")
        await timed_interleaved({"api_bf16": bf16, "api_fp32": fp32})
        out["api_bf16_alone"] = saved

    try:
        if await sec.run("api_connect", s_connect):
            if await sec.run("api_bf16", s_bf16):
                await sec.run("api_fp32", s_fp32)
    finally:
        out["api_rounds"] = last
        if eng[0] is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await eng[0].close()


async def traced_round(tr: Any, srcs: Any, pipeline: Any) -> list[dict[str, float]]:
    """One pipeline round with per-bucket stage / transfer / unpack times (loop clock)."""
    t0 = time.perf_counter()
    recs: dict[int, dict[str, float]] = {}

    def now() -> float:
        return round(time.perf_counter() - t0, 6)

    orig_stage, orig_transfer, orig_unpack = tr.stage, tr.transfer, tr.unpack

    async def stage(bucket: Any, **kw: Any) -> Any:
        r = recs.setdefault(bucket.index, {"bucket": bucket.index})
        r["pack0"] = now()
        st = await orig_stage(bucket, **kw)
        r["pack1"] = now()
        return st

    def transfer(st: Any) -> Any:
        r = recs[st.bucket.index]
        r["transfer0"] = now()
        c = orig_transfer(st)
        c.signal.add_done_callback(lambda _s: r.__setitem__("transfer1", now()))
        return c

    async def unpack(st: Any, sinks: Any) -> None:
        r = recs[st.bucket.index]
        r["unpack0"] = now()
        await orig_unpack(st, sinks)
        r["unpack1"] = now()

    tr.stage, tr.transfer, tr.unpack = stage, transfer, unpack
    try:
        await pipeline(tr, srcs)
    finally:
        del tr.stage, tr.transfer, tr.unpack  # back to the class methods
    return [recs[k] for k in sorted(recs)]




async def broadcast_baseline(ctx: _world.RankCtx, plan: Any, sources: Any, targets: Any,
                             want: Any, timed: Any, close: Any) -> dict[str, Any]:
    """vLLM's packed-broadcast backend, for any plan of one dtype: every other trainer sends the
    shards rank 0 lacks (``bcast_sends``), rank 0 assembles the full tensors and broadcasts
    them in buckets (1 GiB as vLLM for models of 4 GiB or more, else 64 MiB so that
    double-buffering still happens) over all ranks, double-buffered on two streams; workers
    copy their own box of each tensor out of each bucket."""
    import torch

    dtypes = {p.spec.dtype for p in plan.params}
    if len(dtypes) != 1:
        raise ValueError(f"packed broadcast needs one dtype, the plan has {sorted(dtypes)}")
    dtype = getattr(torch, dtypes.pop())
    tb = await _world.open_transport(ctx, "nccl", plan, bucket_bytes=1 << 20, max_inflight=1,
                                     tag="bench-bcast")
    try:
        comm, native = tb.comm, tb.ctx.native
        rank, dev = ctx.rank, ctx.device
        t_ranks = ctx.trainer_ranks
        names = [p.spec.name for p in plan.params]
        total = sum(p.spec.nbytes for p in plan.params)
        bucket = BCAST_BUCKET_LARGE if total >= 4 << 30 else BCAST_BUCKET
        runs = bcast_buckets(plan, bucket)
        numels = [math.prod(p.spec.shape) for p in plan.params]
        cap = max(sum(numels[a:b]) for a, b in runs)
        streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
        bufs = [torch.empty(cap, dtype=dtype, device=dev) for _ in range(2)]
        sends = bcast_sends(plan)
        recv_numel = {r: sum(math.prod(hi - lo for lo, hi in box) for _i, box in items)
                      for r, items in sends.items()}
        boxes = (None if targets is None else
                 [_slices(p.dst.box(tuple(p.spec.shape), rank)) for p in plan.params])

        def one_round() -> None:
            s0 = streams[0]
            full: list[Any] = []
            if 0 < rank < t_ranks and sends[rank]:
                with torch.cuda.stream(s0):  # pack and send on one stream
                    mine = torch.cat([sources[names[i]].reshape(-1) for i, _b in sends[rank]])
                    comm.send(mine, 0, stream=s0.cuda_stream)
            if rank == 0:
                received = {}
                for peer, n in recv_numel.items():
                    if n:
                        received[peer] = torch.empty(n, dtype=dtype, device=dev)
                        comm.recv(received[peer], peer, stream=s0.cuda_stream)
                with torch.cuda.stream(s0):
                    full = assemble_full(plan, sources, received, sends)
            streams[1].wait_stream(s0)
            for k, (a, b) in enumerate(runs):
                s = streams[k % 2]
                buf = bufs[k % 2][:sum(numels[a:b])]
                if rank == 0:
                    with torch.cuda.stream(s):
                        torch.cat([f.reshape(-1) for f in full[a:b]], out=buf)
                comm.broadcast(buf, buf, 0, stream=s.cuda_stream)
                if targets is not None:
                    assert boxes is not None
                    with torch.cuda.stream(s):
                        off = 0
                        for i in range(a, b):
                            view = buf[off:off + numels[i]].view(tuple(plan.params[i].spec.shape))
                            targets[names[i]].copy_(view[boxes[i]])
                            off += numels[i]
            for s in streams:
                s.synchronize()

        async def bcast() -> None:
            await native.run(one_round)

        out: dict[str, Any] = {}
        if targets is not None:
            for v in targets.values():
                v.zero_()
        await timed("broadcast", bcast)
        if want is not None:
            out["bad_broadcast"] = _world.mismatches(targets, want)[:20]
        out["broadcast_buckets"] = len(runs)
        return out
    finally:
        await close(tb, "broadcast")


BCAST_BUCKET = 64 << 20  # vLLM uses 1 GiB; the small models are 256 MiB - 1 GiB: double-buffer
BCAST_BUCKET_LARGE = 1 << 30
NVLINK_GBPS = 370.0  # NCCL's effective NVLink bandwidth per H200 (docs/nccl-m2n.md §5)


# -- threshold sweep: where does one M2N call become bandwidth-bound? --------------------------


def threshold_plan(size: int, count: int, trainers: int, workers: int) -> Any:
    """``count`` bf16 tensors that every rank moves ``size`` bytes of (the lane's
    ``param_cost``): (rows, 1024), trainers ``Shard(0)`` -> workers ``Shard(1)``."""
    r = _world.R
    rows = size * min(trainers, workers) // 2048  # global bytes = size x min(T, N)
    defs = [(f"t{size}.{i}", (rows, 1024), "bfloat16", (r, 0), (r, 1)) for i in range(count)]
    return _world.make_plan(defs, (1, trainers), (1, workers))


def threshold_count(size: int, total: int, max_count: int) -> int:
    return max(4, min(max_count, total // size))


async def threshold_rank(ctx: _world.RankCtx) -> dict[str, Any]:
    import torch

    from m2n_async._data._cuda import m2n_module

    case = ctx.case
    t_ranks, n_ranks = ctx.trainer_ranks, ctx.world_size - ctx.trainer_ranks
    trainer = ctx.rank < t_ranks
    dev = ctx.device
    out: dict[str, Any] = {"gpu": dev.index, "gpu_name": torch.cuda.get_device_name(dev),
                           "sizes": {}}
    sec = _Sections(ctx, out, limit=300.0)
    tiny = threshold_plan(64 << 10, 1, t_ranks, n_ranks)
    t = await _world.open_transport(ctx, "m2n", tiny, bucket_bytes=1 << 20, max_inflight=1,
                                    tag="threshold", max_cta=case.get("max_cta"))
    m2n = m2n_module()
    stream = torch.cuda.Stream()
    side = torch.cuda.Stream()
    seq = [0]

    def calls(descs: Any) -> None:
        sptr = stream.cuda_stream
        for src, dst in descs:
            t.handle.reshard(t.comm, src, dst, stream=sptr)
        stream.synchronize()

    try:
        for size in case["sizes"]:
            count = threshold_count(size, case["total_bytes"], case["max_count"])

            async def s_size(size: int = size, count: int = count) -> None:
                plan = threshold_plan(size, count, t_ranks, n_ranks)
                sources = _world.source_shards(plan, ctx.rank, 0, dev) if trainer else None
                targets = None if trainer else _world.zero_targets(plan, ctx.rank, dev)
                group = (tuple(range(count)),)
                descs, _ = raw_descriptors(m2n, plan, ctx.rank, sources, targets)
                sdescs, sbufs = raw_descriptors(m2n, plan, ctx.rank, sources, targets, group)
                stacked = sbufs[0][1]
                mine = list(sources.values()) if sources is not None else list(targets.values())
                parts = list(stacked.unbind(0))

                def copies() -> None:
                    # what stacking adds: trainer packs into staging, worker scatters from it
                    with torch.cuda.stream(side):
                        if trainer:
                            torch._foreach_copy_(parts, mine)
                        else:
                            torch._foreach_copy_(mine, parts)
                    side.synchronize()

                want = (None if targets is None
                        else _world.expected_shards(plan, ctx.rank, 0, dev))
                times: dict[str, list[float]] = {"per_param": [], "stacked": [], "copy": []}
                rec: dict[str, Any] = {"count": count, "shape": list(plan.params[0].spec.shape)}
                n_slow, n_fast = case["slow_iters"], case["iters"]
                seq[0] += 1
                for it in range(n_fast + 1):
                    for name, fn in (("per_param", lambda: t.ctx.native.run(calls, descs)),
                                     ("stacked", lambda: t.ctx.native.run(calls, sdescs))):
                        if name == "per_param" and it > n_slow:
                            continue
                        await ctx.barrier(f"th{seq[0]}-{name}-{it}", limit=240.0)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        await fn()
                        times[name].append(time.perf_counter() - t0)
                        if it == 0 and want is not None:  # each path's own bytes, once
                            rec[f"bad_{name}"] = (
                                _world.mismatches(targets, want) if name == "per_param"
                                else stacked_mismatches(plan, sbufs, want))[:5]
                    t0 = time.perf_counter()
                    copies()
                    times["copy"].append(time.perf_counter() - t0)
                rec.update({k: v[1:] for k, v in times.items()})
                out["sizes"][str(size)] = rec

            await sec.run(f"size-{size}", s_size)
    finally:
        info = await _world.close_transport(t)
        out.update({f"m2n_{k}": v for k, v in info.items()})
    return out


def summarize_threshold(run: dict[str, Any], trainer_ranks: int = 2,
                        efficiency_goal: float = 0.85) -> dict[str, Any]:
    """Per size: time per call, GB/s of a single call (per-rank bytes / call time) vs one
    stacked call of the same bytes, their ratio (the single call's efficiency), and whether
    stacking (call + both copies) still beats the per-parameter calls."""
    from m2n_async._proto.stacking import COALESCE_BELOW_BYTES

    res = run["results"]
    errors = {r: v["error"] for r, v in res.items() if "error" in v}
    if errors:
        return {"errors": errors, "tracebacks": {r: v.get("traceback") for r, v in res.items()
                                                 if "error" in v}}
    rows: dict[str, dict[str, Any]] = {}
    sizes = sorted({int(s) for v in res.values() for s in v.get("sizes", {})})
    for size in sizes:
        recs = [v["sizes"][str(size)] for v in res.values() if str(size) in v.get("sizes", {})]
        if len(recs) != len(res):
            continue
        count = recs[0]["count"]

        def med(key: str, recs: list[dict[str, Any]] = recs) -> float | None:
            n = min(len(r[key]) for r in recs)
            if n == 0:
                return None
            return statistics.median(max(r[key][i] for r in recs) for i in range(n))

        per, stk, cp = med("per_param"), med("stacked"), med("copy")
        row: dict[str, Any] = {"count": count, "shape": recs[0]["shape"]}
        if per is not None and stk is not None:
            call = per / count
            single_gbps = size / call / 1e9
            stacked_gbps = size * count / stk / 1e9
            row.update({"per_param_s": round(per, 6), "per_call_s": round(call, 7),
                        "single_call_GBps": round(single_gbps, 2), "stacked_s": round(stk, 6),
                        "stacked_GBps": round(stacked_gbps, 2),
                        "single_vs_stacked": round(single_gbps / stacked_gbps, 3)})
            if cp is not None:
                row["copy_s"] = round(cp, 6)
                row["stacking_speedup (per_param / (stacked + copy))"] = round(
                    per / (stk + cp), 3)
        row["bit_exact"] = all(not r.get("bad_stacked") and not r.get("bad_per_param")
                               for r in recs)
        rows[str(size)] = row
    peak = max((r["stacked_GBps"] for r in rows.values() if "stacked_GBps" in r), default=None)
    for r in rows.values():
        if peak and "single_call_GBps" in r:
            r["single_vs_peak_stacked"] = round(r["single_call_GBps"] / peak, 3)
    bound = [int(s) for s, r in rows.items() if r.get("single_vs_stacked", 0) >= efficiency_goal]
    goals = []
    at = rows.get(str(COALESCE_BELOW_BYTES), {})
    val = at.get("single_vs_stacked")
    goals.append(_goal(f"threshold sweep: one call of {_fmt_bytes(COALESCE_BELOW_BYTES)} "
                       f"(COALESCE_BELOW_BYTES) runs at >= {efficiency_goal:.0%} of the stacked "
                       f"call's GB/s", val, ">=", efficiency_goal))
    errs = {r: v.get("errors") for r, v in res.items() if v.get("errors")}
    return {"sizes": rows, "peak_stacked_GBps": peak,
            "smallest_bandwidth_bound_size": min(bound) if bound else None,
            "goals": goals, **({"path_errors": errs} if errs else {})}


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def write_timeline_png(path: str, lanes: dict[str, list[dict[str, float]]]) -> None:
    """A dependency-free PNG: one row per (rank, stage), one box per bucket (pack blue,
    transfer orange, unpack green), time left to right."""
    import struct
    import zlib

    width, row_h, pad = 1200, 14, 2
    colors = {"pack": (52, 101, 164), "transfer": (245, 121, 0), "unpack": (78, 154, 6)}
    rows = [(label, stage) for label in lanes for stage in ("pack", "transfer", "unpack")]
    height = len(rows) * row_h + 2 * pad
    end = max((r.get(f"{st}1", 0.0) for recs in lanes.values() for r in recs
               for st in colors), default=1.0) or 1.0
    px = [[(255, 255, 255)] * width for _ in range(height)]
    for y_i, (label, stage) in enumerate(rows):
        y0 = pad + y_i * row_h
        for x in range(width):  # lane separator
            px[y0 + row_h - 1][x] = (225, 225, 225)
        prev_end = 0.0
        for k, r in enumerate(lanes[label]):
            a, b = r.get(f"{stage}0"), r.get(f"{stage}1")
            if a is None or b is None:
                continue
            if stage == "transfer":
                # submitted at a, but one stream runs the buckets' transfers one after another
                a = max(a, prev_end)
                prev_end = b
            x0 = int(a / end * (width - 1))
            x1 = max(x0 + 1, int(b / end * (width - 1)))
            c = colors[stage] if k % 2 == 0 else tuple(min(255, v + 60) for v in colors[stage])
            for y in range(y0 + 2, y0 + row_h - 3):
                for x in range(x0, min(x1, width)):
                    px[y][x] = c
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0,
                                                              0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)




# -- summaries ---------------------------------------------------------------------------------

#: Every timed path, in the order the table prints them.
PATHS = ("m2n", "m2n_nocoalesce", "nccl", "api_bf16", "api_fp32", "api_bf16_alone", "raw",
         "raw_stacked", "per_param", "broadcast", "m2n_cast", "pack_lane", "pack_only",
         "pack_per_tensor", "pack_flat", "raw_after_default_stream_event", "raw_transfer_stream",
         "raw_build_descs", "m2n_cast_one_fence", "m2n_blocking_events", "m2n_poll_events",
         "m2n_bucket_64MiB", "m2n_bucket_1GiB", "m2n_one_bucket", "raw_stacked_pair", "m2n_pair",
         "raw_stacked_alone", "m2n_alone")


def _goal(text: str, value: float | None, op: str, target: float) -> dict[str, Any]:
    ok = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"goal": text, "value": None if value is None else round(value, 4),
            "target": f"{op} {target:g}", "pass": ok}


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def model_goals(model: str | None, s: Mapping[str, float]) -> list[dict[str, Any]]:
    """The goals of the coalescing work that this model's figures can check (``s``: path ->
    median seconds; a missing path makes its goal n/a)."""
    g = s.get
    out = []
    if model == "moe":
        out.append(_goal("MoE: engine (m2n, coalescing on) / raw stacked reshard of the same "
                         "bytes", _div(g("m2n"), g("raw_stacked")), "<=", 1.5))
        out.append(_goal("MoE: per-param m2n (coalescing off) / engine (coalescing on)",
                         _div(g("m2n_nocoalesce"), g("m2n")), ">=", 50))
        # The pack goal is the lane's own stage (its Triton stack copy, cached tables):
        # ``pack_only`` is the foreach_copy emulation, kept for comparison.
        out.append(_goal("MoE: the lane's own pack (pack_lane) fp32 -> bf16 (ms)",
                         None if g("pack_lane") is None else g("pack_lane") * 1e3, "<=", 1.5))
    if model == "mixed":
        out.append(_goal("mixed: packed broadcast / engine (m2n, coalescing on)",
                         _div(g("broadcast"), g("m2n")), ">=", 3))
        out.append(_goal("mixed: packed broadcast / public API (auto, bf16 sources)",
                         _div(g("broadcast"), g("api_bf16")), ">=", 3))
    if model in ("dense", "large"):
        out.append(_goal(f"{model}: engine / raw (raw / m2n)", _div(g("raw"), g("m2n")),
                         ">=", 0.95))
    pack = g("pack_only")
    out.append(_goal(f"{model}: cast sync / max(pack, transfer) (m2n_cast / max(pack_only, "
                     f"m2n))", _div(g("m2n_cast"), None if pack is None or g("m2n") is None
                                    else max(pack, g("m2n"))), "<=", 1.1))
    out.append(_goal(f"{model}: public API cast sync / max(pack, transfer) (api_fp32 / "
                     f"max(pack_only, api_bf16))",
                     _div(g("api_fp32"), None if pack is None or g("api_bf16") is None
                          else max(pack, g("api_bf16"))), "<=", 1.1))
    return out


def summarize(run: dict[str, Any], trainer_ranks: int = 2,
              link_gbps: float = NVLINK_GBPS, model: str | None = None) -> dict[str, Any]:
    res = run["results"]
    errors = {r: v["error"] for r, v in res.items() if "error" in v}
    if errors:
        return {"errors": errors, "tracebacks": {r: v.get("traceback") for r, v in res.items()
                                                 if "error" in v}}

    def timed_on_all(n: str) -> bool:
        return all(isinstance(v.get(n), list) and v[n] for v in res.values())

    names = [n for n in PATHS if timed_on_all(n)]
    names += sorted((n for n in res[0] if n.startswith("sweep_") and n[6:].isdigit()
                     and timed_on_all(n)), key=lambda n: int(n[6:]))
    summary: dict[str, Any] = {}
    workers = [r for r in res if r >= trainer_ranks]
    nbytes = sum(res[r]["bytes"] for r in workers)
    # bytes into / out of each GPU; with trainers and workers on different GPUs every one of
    # them crosses NVLink, and the busiest GPU at ``link_gbps`` bounds the round from below
    gpu_in: dict[int, int] = {}
    gpu_out: dict[int, int] = {}
    for r, v in res.items():
        side = gpu_out if r < trainer_ranks else gpu_in
        side[v["gpu"]] = side.get(v["gpu"], 0) + v["bytes"]
    split = not set(gpu_in) & set(gpu_out)
    bound_s = max(list(gpu_in.values()) + list(gpu_out.values())) / (link_gbps * 1e9)
    for name in names:
        n = min(len(v[name]) for v in res.values())
        per_iter = [max(v[name][i] for v in res.values()) for i in range(n)]
        slowest = [max(res, key=lambda r, i=i: res[r][name][i]) for i in range(n)]
        med = statistics.median(per_iter)
        summary[name] = {"median_s": round(med, 6), "GBps": round(nbytes / med / 1e9, 2),
                         "GBps_per_receiving_gpu": round(max(gpu_in.values()) / med / 1e9, 2),
                         "all_s": [round(x, 6) for x in per_iter],
                         # which rank bounded each iteration (rank 0 serves the store)
                         "slowest_rank": dict(sorted(collections.Counter(slowest).items()))}
        if split:
            summary[name][f"efficiency_vs_{link_gbps:g}GBps"] = round(bound_s / med, 3)
    s = {k: v["median_s"] for k, v in summary.items()}

    def ratio(a: str, b: str) -> float | None:
        r = _div(s.get(a), s.get(b))
        return None if r is None else round(r, 3)

    summary["ratios"] = {
        "m2n_vs_raw (raw/m2n, goal >= 0.95)": ratio("raw", "m2n"),
        "m2n_vs_raw_stacked (m2n/raw_stacked)": ratio("m2n", "raw_stacked"),
        "m2n_vs_per_param (per_param/m2n, goal >= 1.5)": ratio("per_param", "m2n"),
        "nocoalesce_vs_m2n (m2n_nocoalesce/m2n)": ratio("m2n_nocoalesce", "m2n"),
        "m2n_vs_raw_stacked, the pair alone interleaved (m2n_pair/raw_stacked_pair)":
            ratio("m2n_pair", "raw_stacked_pair"),
        "m2n_vs_raw_stacked, each back to back (m2n_alone/raw_stacked_alone)":
            ratio("m2n_alone", "raw_stacked_alone"),
        "raw_vs_raw_stacked (raw/raw_stacked)": ratio("raw", "raw_stacked"),
        "nccl_vs_raw (raw/nccl)": ratio("raw", "nccl"),
        "broadcast_vs_m2n (broadcast/m2n)": ratio("broadcast", "m2n"),
        "api_bf16_vs_m2n (api_bf16/m2n)": ratio("api_bf16", "m2n"),
        "cast_overlap (m2n_cast / max(pack_only, m2n), goal <= 1.1)":
            None if "m2n_cast" not in s or "pack_only" not in s or "m2n" not in s
            else round(s["m2n_cast"] / max(s["pack_only"], s["m2n"]), 3),
        "api_cast_overlap (api_fp32 / max(pack_only, api_bf16), goal <= 1.1)":
            None if "api_fp32" not in s or "pack_only" not in s or "api_bf16" not in s
            else round(s["api_fp32"] / max(s["pack_only"], s["api_bf16"]), 3),
    }
    firsts = [v.get("first_s") or {} for v in res.values()]
    summary["first_s"] = {n: round(max(f[n] for f in firsts), 6) for n in names
                          if all(n in f for f in firsts)}
    summary["kernel_variants"] = {r: v.get("kernel_variants") for r, v in res.items()}
    summary["goals"] = model_goals(model, s)
    summary["bytes_received_by_workers"] = nbytes
    summary["params"] = res[0].get("params")
    summary["calls"] = res[0].get("calls")
    summary["gpus"] = {"trainers": sorted(gpu_out), "workers": sorted(gpu_in),
                       "names": sorted({v.get("gpu_name", "?") for v in res.values()}),
                       "bytes_in_per_gpu": gpu_in, "bytes_out_per_gpu": gpu_out,
                       "split": split, "lower_bound_s": round(bound_s, 6)}
    if "trace" in res[0]:
        summary["trace"] = {r: v["trace"] for r, v in res.items()}
    summary["grouping"] = res[0].get("grouping")
    bad = {k[4:]: {r: v[k] for r, v in res.items() if v.get(k)}
           for k in sorted({k for v in res.values() for k in v if k.startswith("bad_")})}
    summary["bit_exact_paths"] = {k: not v for k, v in bad.items()}
    summary["bit_exact"] = all(summary["bit_exact_paths"].values())
    if any(bad.values()):
        summary["mismatches"] = {k: v for k, v in bad.items() if v}
    path_errors: dict[str, dict[int, str]] = {}
    for r, v in res.items():
        for sec, msg in (v.get("errors") or {}).items():
            path_errors.setdefault(sec, {})[r] = msg
    if path_errors:
        summary["path_errors"] = path_errors
        summary["path_tracebacks"] = {r: v["tracebacks"] for r, v in res.items()
                                      if v.get("tracebacks")}
    abandoned = {r: v["abandoned"] for r, v in res.items() if v.get("abandoned")}
    if abandoned:
        summary["abandoned"] = abandoned
    if "api_rounds" in res[0] or "api_rounds" in res.get(trainer_ranks, {}):
        summary["api_rounds"] = {r: v.get("api_rounds") for r, v in res.items()}
    sweep = {}
    for n in names:
        if n.startswith("sweep_"):
            sweep[n] = {**res[0].get(f"{n}_config", {}), "median_s": summary.pop(n)["median_s"]}
    if sweep:
        summary["sweep_m2n"] = sweep
    summary["m2n_teardown_finished"] = all(v.get("m2n_teardown_finished", True)
                                           for v in res.values())
    summary["teardown_finished"] = all(
        v.get(k, True) for v in res.values() for k in v if k.endswith("_teardown_finished"))
    return summary


def goal_lines(goals: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for g in goals:
        verdict = {True: "PASS", False: "FAIL", None: "N/A "}[g["pass"]]
        value = "n/a (path missing or failed)" if g["value"] is None else f"{g['value']:g}"
        out.append(f"GOAL {verdict} {g['goal']}: {value} (goal {g['target']})")
    return out


def table_lines(summary: Mapping[str, Any]) -> list[str]:
    """A side-by-side table of the timed paths (median seconds, GB/s into the workers)."""
    calls = summary.get("calls") or {}
    rows = [f"{'path':<32} {'median_s':>10} {'GB/s':>8}  calls"]
    for name in PATHS:
        v = summary.get(name)
        if isinstance(v, Mapping) and "median_s" in v:
            c = calls.get(name, calls.get(f"{name} (predicted)", ""))
            rows.append(f"{name:<32} {v['median_s']:>10.5f} {v['GBps']:>8.2f}  {c}")
    errs = summary.get("path_errors") or {}
    for sec, per in errs.items():
        rows.append(f"{'! ' + sec:<32} failed: {next(iter(per.values()))[:150]}")
    api = (summary.get("api_rounds") or {}).get(0) or {}
    for tag in ("api_bf16", "api_fp32"):
        if tag in api:
            rows.append(f"{tag}: transport {api[tag]['transport']!r}, predicted "
                        f"{api[tag].get('predicted_seconds')} s ({api[tag]['reason'][:120]})")
    r = summary.get("ratios") or {}
    orders = [(label, r.get(key)) for label, key in (
        ("interleaved with every path", "m2n_vs_raw_stacked (m2n/raw_stacked)"),
        ("the pair alone interleaved",
         "m2n_vs_raw_stacked, the pair alone interleaved (m2n_pair/raw_stacked_pair)"),
        ("each back to back",
         "m2n_vs_raw_stacked, each back to back (m2n_alone/raw_stacked_alone)"))]
    if sum(v is not None for _, v in orders) > 1:
        rows.append("engine / raw stacked, by the order of paths: "
                    + "; ".join(f"{label} {v}" for label, v in orders if v is not None))
    first = summary.get("first_s") or {}
    if "m2n" in first:
        kv = summary.get("kernel_variants") or {}
        rows.append("first (dropped) iteration: " + ", ".join(
            f"{n} {first[n]:.5f} s"
            for n in ("m2n", "raw_stacked", "m2n_cast", "api_bf16", "api_fp32") if n in first)
            + "; Triton copy forms compiled per rank, at connect -> after the rounds: "
            + ", ".join(f"{r}: {v.get('connected')} -> {v.get('after_rounds')}"
                        for r, v in kv.items() if v))
    gp = summary.get("gpus") or {}
    rows.append(f"bytes received by workers: {summary.get('bytes_received_by_workers')}; "
                f"lower bound at the link rate: {gp.get('lower_bound_s')} s; bit-exact: "
                f"{summary.get('bit_exact')}")
    return rows


def threshold_lines(summary: Mapping[str, Any]) -> list[str]:
    rows = [f"{'per-rank size':>14} {'count':>6} {'per call s':>11} {'single GB/s':>12} "
            f"{'stacked GB/s':>13} {'single/stacked':>15} {'copy s':>9}"]
    for size, r in (summary.get("sizes") or {}).items():
        if "per_call_s" not in r:
            continue
        rows.append(f"{_fmt_bytes(int(size)):>14} {r['count']:>6} {r['per_call_s']:>11.7f} "
                    f"{r['single_call_GBps']:>12.2f} {r['stacked_GBps']:>13.2f} "
                    f"{r['single_vs_stacked']:>15.3f} {r.get('copy_s', float('nan')):>9.5f}")
    return rows


# -- command line ------------------------------------------------------------------------------


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations of fast paths")
    ap.add_argument("--slow-iters", type=int, default=2,
                    help="timed iterations of per-parameter paths (raw, per_param, "
                         "m2n_nocoalesce: ~0.6 ms a reshard on one shared GPU)")
    ap.add_argument("--bucket-bytes", type=int, default=256 << 20)
    ap.add_argument("--max-inflight", type=int, default=3)
    ap.add_argument("--max-cta", type=int, default=None,
                    help="M2N max_cta of the m2n lane and the raw figures (default: M2N's)")
    ap.add_argument("--coalesce-below", type=_size, default=None,
                    help="the lane's coalesce_below (bytes, or 16M, 256K...; default: "
                         "_proto.stacking.COALESCE_BELOW_BYTES)")
    ap.add_argument("--trainers", type=int, default=2, help="trainer ranks (mesh 1 x T)")
    ap.add_argument("--workers", type=int, default=2, help="worker ranks (mesh 1 x N)")
    ap.add_argument("--link-gbps", type=float, default=NVLINK_GBPS,
                    help="per-GPU bandwidth for the efficiency figure (multi-GPU only)")
    ap.add_argument("--timeout", type=float, default=600.0, help="whole world (seconds)")
    ap.add_argument("--round-deadline", type=float, default=90.0,
                    help="seconds one pipeline or API round may take before it fails")
    ap.add_argument("--one-buffer", action="store_true",
                    help="sources and targets as views of one buffer per rank, each stack's "
                         "members back to back (a flat parameter buffer): the m2n lane "
                         "reshards those stacks in place")
    ap.add_argument("--settle", type=float, default=1.0, metavar="F",
                    help="after each timed call a rank waits F times what it took (at most "
                         f"{SETTLE_MAX_S} s) before the next barrier, so no rank's barrier "
                         "request reaches the store while another still finishes its call; "
                         "0: the next barrier at once (the bench before this option)")
    ap.add_argument("--store", choices=("rank0", "thread", "process"), default="rank0",
                    help="where the store runs: trainer rank 0's event loop (default, a job "
                         "serving it from its training loop), a thread of rank 0 "
                         "(StoreServer.in_thread, as the vLLM backend) or a process of its "
                         "own (as `m2n-async store` beside a job)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time raw-call variants, the m2n lane with blocking-sync events "
                         "and other buckets, and trace one pipeline round")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="trace one m2n and one nccl round; write timeline_*.png there")
    ap.add_argument("--broadcast", action=argparse.BooleanOptionalAction, default=None,
                    help=f"time the packed-broadcast baseline (default: on for "
                         f"{', '.join(BROADCAST_BY_DEFAULT)})")
    ap.add_argument("--api", action=argparse.BooleanOptionalAction, default=True,
                    help="time the public API (TrainerEngine/WorkerEngine, bf16 and fp32 "
                         "sources), last in the run")
    ap.add_argument("--api-marks", metavar="DIR", default=None,
                    help="record each rank's public-API steps into DIR and print their "
                         "timeline (bench/api_marks.py)")
    ap.add_argument("--api-transport", default="auto", choices=("auto", "m2n", "nccl"))
    ap.add_argument("--sweep", action="store_true",
                    help="m2n over bucket_bytes x max_inflight x max_cta (1 iteration each)")
    ap.add_argument("--sweep-bucket-mb", default="16,64,256",
                    help="bucket sizes of the sweep (MiB, comma-separated)")
    ap.add_argument("--sweep-inflight", default="1,3", help="max_inflight values of the sweep")
    ap.add_argument("--sweep-cta", default="none",
                    help="max_cta values of the sweep ('none' = M2N's default)")
    ap.add_argument("--threshold-sweep", action="store_true",
                    help="instead of a model: per-parameter vs stacked M2N per per-rank size")
    ap.add_argument("--threshold-sizes", default=",".join(_fmt_bytes(s).replace(" ", "")
                                                          for s in THRESHOLD_SIZES),
                    help="per-rank sizes of the threshold sweep (64KiB,256KiB,...)")
    ap.add_argument("--threshold-total", type=_size, default=256 << 20,
                    help="per-rank bytes per size (count = total / size, within [4, max])")
    ap.add_argument("--threshold-max-count", type=int, default=1024)
    ap.add_argument("--out", default=None, help="append the JSON summary to this file")
    return ap


def build_case(args: argparse.Namespace) -> dict[str, Any]:
    from m2n_async._proto.stacking import COALESCE_BELOW_BYTES

    if args.threshold_sweep:
        return {"threshold_sweep": True, "iters": args.iters, "slow_iters": args.slow_iters,
                "max_cta": args.max_cta,
                "sizes": [_size(x) for x in args.threshold_sizes.split(",") if x.strip()],
                "total_bytes": args.threshold_total, "max_count": args.threshold_max_count}
    broadcast = (args.model in BROADCAST_BY_DEFAULT if args.broadcast is None
                 else args.broadcast)
    return {"model": args.model, "iters": args.iters, "slow_iters": args.slow_iters,
            "bucket_bytes": args.bucket_bytes, "max_inflight": args.max_inflight,
            "max_cta": args.max_cta, "diagnose": args.diagnose, "one_buffer": args.one_buffer,
            "store": args.store, "settle": args.settle,
            "coalesce_below": (COALESCE_BELOW_BYTES if args.coalesce_below is None
                               else args.coalesce_below),
            "round_deadline": args.round_deadline, "timeline": bool(args.timeline),
            "broadcast": broadcast, "api": args.api, "api_transport": args.api_transport,
            "api_marks": os.path.abspath(args.api_marks) if args.api_marks else None,
            "sweep": [[int(bb) << 20, int(mi), None if cta == "none" else int(cta)]
                      for bb in args.sweep_bucket_mb.split(",")
                      for mi in args.sweep_inflight.split(",")
                      for cta in args.sweep_cta.split(",")] if args.sweep else []}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    case = build_case(args)
    t0 = time.time()
    scenario = ("gpu_sync_bench:threshold_rank" if args.threshold_sweep
                else "gpu_sync_bench:bench_rank")
    run = _world.run_world(scenario, case, trainer_ranks=args.trainers,
                           world_size=args.trainers + args.workers, timeout=args.timeout)
    head = {"case": case, "topology": f"{args.trainers}+{args.workers}",
            "wall_s": round(time.time() - t0, 1), "exitcodes": run["exitcodes"]}
    missing = [r for r in range(args.trainers + args.workers) if r not in run["results"]]
    if missing:
        head["missing_ranks"] = missing  # killed at --timeout: a hang
    try:
        if args.threshold_sweep:
            summary = {**head, **summarize_threshold(run, args.trainers)}
            lines = threshold_lines(summary)
        else:
            summary = {**head, **summarize(run, args.trainers, args.link_gbps, args.model)}
            lines = table_lines(summary) if "errors" not in summary else []
    except Exception as exc:  # the raw results still reach the output
        summary = {**head, "summary_error": f"{type(exc).__name__}: {exc}",
                   "results": run["results"]}
        lines = []
    if args.timeline and "errors" not in summary:
        os.makedirs(args.timeline, exist_ok=True)
        for label in ("m2n", "nccl"):
            lanes = {f"rank {r}": v[f"timeline_{label}"] for r, v in
                     sorted(run["results"].items()) if f"timeline_{label}" in v}
            if lanes:
                path = os.path.join(args.timeline, f"timeline_{label}_{args.model}.png")
                write_timeline_png(path, lanes)
                summary[f"timeline_{label}"] = {"png": path, "lanes": lanes}
    print(json.dumps(summary, indent=1, default=repr))
    title = ("threshold sweep" if args.threshold_sweep else f"model {args.model}"
             + (" (sources and targets in one buffer)" if args.one_buffer else ""))
    print(f"\n== {title}, {args.trainers}+{args.workers}, {summary['wall_s']} s ==")
    for line in lines + goal_lines(summary.get("goals", [])):
        print(line)
    if args.api_marks:
        import api_marks

        print(f"\n== the public API's steps (bench/api_marks.py, {args.api_marks}) ==")
        print(api_marks.summarize(args.api_marks))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary, default=repr) + "\n")
    return 0 if "errors" not in summary and not missing else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
