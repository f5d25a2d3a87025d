"""Plan bench: build + validate + digest + geometry of a DeepSeek-V3-scale plan, and the wire.

Theory of operation: builds a synthetic plan of ``--params`` tensors (default 100,000; MoE
expert weights dominate, as in DeepSeek-V3) over ``--trainers`` + ``--workers`` ranks (default
64 + 64) with a mix of FSDP-, TP- and fully replicated source layouts and TP/DP destination
layouts, then times, on one core, each stage the handshake and engine run: spec construction,
plan validation, both digests, geometry (pieces of every param, per-rank bytes, fan-in/out,
limits), buckets and the cost model's prediction per lane. Last it encodes and decodes the
plan record with msgspec side by side with pickle and json in the same run (pickle is only a
yardstick here: it never goes on the wire).

Run: ``.venv/bin/python bench/plan_bench.py`` (``--params 10000`` for a quick look).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from m2n_async._proto import messages
from m2n_async._proto.cost import DEFAULT_LANES, cost_inputs, predict
from m2n_async._proto.errors import PlanError
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import (
    TransferPlan,
    check_plan_limits,
    complete_plan_digest,
    source_plan_digest,
)
from m2n_async._proto.stacking import COALESCE_BELOW_BYTES

T = TypeVar("T")


def build_transfers(n_params: int, trainers: int, workers: int) -> list[ParamTransfer]:
    """A synthetic MoE-shaped plan: per layer attention/norm tensors, then many experts."""
    fsdp = Layout(Mesh((trainers, 1), 0), (0, REPLICATE))           # FSDP: shard dim 0
    fsdp1 = Layout(Mesh((trainers, 1), 0), (1, REPLICATE))          # FSDP on dim 1
    tp = Layout(Mesh((trainers // 8, 8), 0), (REPLICATE, 1))         # DP x TP(8) on dim 1
    rep = Layout(Mesh((trainers, 1), 0), None)                       # replicated (norms)
    w_tp0 = Layout(Mesh((workers // 8, 8), trainers), (REPLICATE, 0))  # DP x TP(8) on dim 0
    w_tp1 = Layout(Mesh((workers // 8, 8), trainers), (REPLICATE, 1))  # DP x TP(8) on dim 1
    w_rep = Layout(Mesh((workers, 1), trainers), None)
    out: list[ParamTransfer] = []
    layer = 0
    while len(out) < n_params:
        pre = f"model.layers.{layer}"
        out.append(ParamTransfer(ParamSpec(f"{pre}.input_layernorm.weight", "bfloat16",
                                           (7168,), rep), w_rep))
        out.append(ParamTransfer(ParamSpec(f"{pre}.self_attn.q_proj.weight", "bfloat16",
                                           (24576, 1536), fsdp), w_tp0))
        out.append(ParamTransfer(ParamSpec(f"{pre}.self_attn.o_proj.weight", "bfloat16",
                                           (7168, 16384), tp), w_tp1))
        for e in range(256):
            for proj, shape, dst in (("gate_proj", (2048, 7168), w_tp0),
                                     ("up_proj", (2048, 7168), w_tp0),
                                     ("down_proj", (7168, 2048), w_tp1)):
                src = fsdp1 if proj == "down_proj" else fsdp
                out.append(ParamTransfer(ParamSpec(f"{pre}.mlp.experts.{e}.{proj}.weight",
                                                   "float8_e4m3fn", shape, src), dst))
        layer += 1
    return out[:n_params]


def timed(label: str, fn: Callable[[], T], rows: dict[str, list[float]]) -> T:
    t0 = time.perf_counter()
    result = fn()
    rows.setdefault(label, []).append(time.perf_counter() - t0)
    return result


def one_run(args: argparse.Namespace, rows: dict[str, list[float]]) -> TransferPlan:
    """Every stage once, from nothing (a fresh plan has empty caches)."""
    T_, N = args.trainers, args.workers
    t_all = time.perf_counter()
    transfers = timed("build specs + transfers", lambda: build_transfers(args.params, T_, N),
                      rows)
    plan = timed("TransferPlan(...) (validates)",
                 lambda: TransferPlan(transfers, trainer_ranks=T_, world_size=T_ + N), rows)
    timed("validate('m2n')", lambda: plan.validate("m2n"), rows)
    specs = plan.source_specs()
    timed("source_plan_digest", lambda: source_plan_digest(specs, T_), rows)
    timed("complete_plan_digest", lambda: complete_plan_digest(plan), rows)
    timed("geometry + check_plan_limits('m2n')", lambda: check_plan_limits(plan, "m2n"), rows)
    timed("per-rank bytes + lower bound", lambda: plan.lower_bound_seconds(50e9), rows)
    timed("pieces() of every param", lambda: [plan.pieces(i) for i in range(len(plan))], rows)
    timed(f"buckets({args.bucket_mib} MiB)", lambda: plan.buckets(args.bucket_mib << 20), rows)
    # The handshake's cost-model prediction (``auto`` picks a lane by it): every lane's
    # calls (the m2n lane's stacked calls per bucket) and bytes.
    costs = cost_inputs(DEFAULT_LANES, dict.fromkeys(DEFAULT_LANES, args.bucket_mib << 20),
                        COALESCE_BELOW_BYTES)
    timed("cost.predict (every lane)", lambda: predict(plan, costs), rows)
    rows.setdefault(TOTAL, []).append(time.perf_counter() - t_all)
    return plan


#: The label the smoke test reads; the cost prediction row is part of the total.
TOTAL = "**total (build + validate + digests + geometry + buckets)**"


#: The trainer counts ``build_transfers`` takes: TP groups of 8, FSDP shards that divide 2048
#: rows, and a fan-in (trainers / 8 source shards into a worker's TP shard) within M2N's 16.
TRAINERS = (8, 16, 32, 64, 128)
TRAINER_CHOICES = ", ".join(map(str, TRAINERS[:-1])) + f" or {TRAINERS[-1]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before anything is built, as far as they can be alone."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--params", type=int, default=100_000,
                    help="tensors in the synthetic plan")
    ap.add_argument("--trainers", type=int, default=64,
                    help=f"trainer ranks: {TRAINER_CHOICES} (TP groups of 8, even FSDP "
                         f"shards, fan-in at most 16 into the workers' TP 8)")
    ap.add_argument("--workers", type=int, default=64,
                    help="worker ranks; a positive multiple of 8 (TP groups of 8)")
    ap.add_argument("--bucket-mib", type=int, default=512, help="bucket size in MiB")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of every stage; the table shows min and median")
    args = ap.parse_args(argv)
    if args.trainers not in TRAINERS:
        ap.error(f"--trainers must be {TRAINER_CHOICES} (TP groups of 8, FSDP shards that "
                 f"divide the experts' 2048 rows, and M2N's fan-in limit of 16 shards into "
                 f"one: trainers / 8), got {args.trainers}")
    if args.workers < 8 or args.workers % 8:
        ap.error(f"--workers must be a positive multiple of 8 (TP groups of 8), got "
                 f"{args.workers}")
    for flag in ("params", "bucket_mib", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        _main(args)
    except PlanError as e:  # what the flags cannot show alone, e.g. bytes per reshard
        sys.exit(f"plan_bench.py: error: --trainers {args.trainers} --workers {args.workers} "
                 f"give a plan M2N refuses: {e}")


def _main(args: argparse.Namespace) -> None:
    rows: dict[str, list[float]] = {}
    plan = None
    for _ in range(args.repeat):
        plan = one_run(args, rows)
    assert plan is not None
    n_pieces = sum(len(plan.pieces(i)) for i in range(len(plan)))
    distinct = len({id(plan.pieces(i)) for i in range(len(plan))})
    print(f"plan: {len(plan)} params, {args.trainers}+{args.workers} ranks, {n_pieces:,} pieces "
          f"({distinct} distinct piece lists), {len(plan.buckets(args.bucket_mib << 20))} "
          f"buckets, {plan.total_bytes() / 2**30:,.1f} GiB moved, lower bound at 50 GB/s per "
          f"rank {plan.lower_bound_seconds(50e9):.3f} s")
    print(f"\n| stage (x{args.repeat}) | min s | median s |\n|---|---:|---:|")
    for label, secs in rows.items():
        print(f"| {label} | {min(secs):.3f} | {statistics.median(secs):.3f} |")

    # --- wire: msgspec vs pickle vs json, same data, same run --------------------------
    record = plan.record()
    as_builtins = msgspec.to_builtins(record)  # what json (and a dict-based design) would ship
    wire: dict[str, tuple[int, list[float], list[float]]] = {}

    def measure(name: str, enc: Callable[[], bytes], dec: Callable[[bytes], object]) -> None:
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            data = enc()
            t1 = time.perf_counter()
            dec(data)
            t2 = time.perf_counter()
            _size, e, d = wire.setdefault(name, (len(data), [], []))
            e.append(t1 - t0)
            d.append(t2 - t1)

    measure("msgspec msgpack (typed Structs, validated on decode)",
            lambda: messages.encode(record), messages.decode)
    measure("pickle (protocol 5, builtins, unvalidated)",
            lambda: pickle.dumps(as_builtins, protocol=5), pickle.loads)
    measure("json (stdlib, builtins, unvalidated)",
            lambda: json.dumps(as_builtins).encode(), json.loads)
    print("\n| encoding of the plan record | bytes | encode s (min) | decode s (min) |\n"
          "|---|---:|---:|---:|")
    for name, (size, e, d) in wire.items():
        print(f"| {name} | {size:,} | {min(e):.3f} | {min(d):.3f} |")


if __name__ == "__main__":
    main()
