"""Plan bench: build + validate + digest + geometry of a DeepSeek-V3-scale plan, and the wire.

Theory of operation: builds a synthetic plan of ``--params`` tensors (default 100,000; MoE
expert weights dominate, as in DeepSeek-V3) over ``--trainers`` + ``--workers`` ranks (default
64 + 64) with a mix of FSDP-, TP- and fully replicated source layouts and TP/DP destination
layouts, then times, on one core, each stage the handshake and engine run: spec construction,
plan validation, both digests, geometry (pieces of every param, per-rank bytes, fan-in/out,
limits) and buckets. Last it encodes and decodes the plan record with msgspec side by side with
pickle and json in the same run (pickle is only a yardstick here: it never goes on the wire).

Run: ``.venv/bin/python bench/plan_bench.py`` (``--params 10000`` for a quick look).
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from m2n_async._proto import messages
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import (
    TransferPlan,
    check_plan_limits,
    complete_plan_digest,
    source_plan_digest,
)

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


def timed(label: str, fn: Callable[[], T], rows: list[tuple[str, float]]) -> T:
    t0 = time.perf_counter()
    result = fn()
    rows.append((label, time.perf_counter() - t0))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=100_000)
    ap.add_argument("--trainers", type=int, default=64)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--bucket-mib", type=int, default=512)
    args = ap.parse_args()
    T_, N = args.trainers, args.workers
    rows: list[tuple[str, float]] = []

    t_all = time.perf_counter()
    transfers = timed("build specs + transfers", lambda: build_transfers(args.params, T_, N),
                      rows)
    plan = timed("TransferPlan(...) (validates)",
                 lambda: TransferPlan(transfers, trainer_ranks=T_, world_size=T_ + N), rows)
    timed("validate('m2n')", lambda: plan.validate("m2n"), rows)
    specs = plan.source_specs()
    timed("source_plan_digest", lambda: source_plan_digest(specs, T_), rows)
    timed("complete_plan_digest", lambda: complete_plan_digest(plan), rows)
    timed("check_plan_limits('m2n')", lambda: check_plan_limits(plan, "m2n"), rows)
    timed("per-rank bytes + lower bound", lambda: plan.lower_bound_seconds(50e9), rows)
    n_pieces = timed("pieces() of every param",
                     lambda: sum(len(plan.pieces(i)) for i in range(len(plan))), rows)
    buckets = timed(f"buckets({args.bucket_mib} MiB)",
                    lambda: plan.buckets(args.bucket_mib << 20), rows)
    total = time.perf_counter() - t_all

    print(f"plan: {len(plan)} params, {T_}+{N} ranks, {n_pieces} pieces, "
          f"{len(buckets)} buckets, {plan.total_bytes() / 2**30:.1f} GiB moved, "
          f"lower bound at 50 GB/s per rank {plan.lower_bound_seconds(50e9):.3f} s")
    print("| stage | seconds |\n|---|---:|")
    for label, sec in rows:
        print(f"| {label} | {sec:.3f} |")
    print(f"| **total (build + validate + digests + geometry + buckets)** | **{total:.3f}** |")

    # --- wire: msgspec vs pickle vs json, same data, same run --------------------------
    record = plan.record()
    as_builtins = msgspec.to_builtins(record)  # what json (and a dict-based design) would ship
    wire: list[tuple[str, int, float, float]] = []

    def measure(name: str, enc: Callable[[], bytes], dec: Callable[[bytes], object]) -> None:
        t0 = time.perf_counter()
        data = enc()
        t1 = time.perf_counter()
        dec(data)
        t2 = time.perf_counter()
        wire.append((name, len(data), t1 - t0, t2 - t1))

    measure("msgspec msgpack (typed, validated)", lambda: messages.encode(record),
            messages.decode)
    measure("pickle (dataclass-free builtins)", lambda: pickle.dumps(as_builtins, protocol=5),
            pickle.loads)
    measure("json (stdlib, builtins)", lambda: json.dumps(as_builtins).encode(), json.loads)
    print("\n| encoding | bytes | encode s | decode s |\n|---|---:|---:|---:|")
    for name, size, enc_s, dec_s in wire:
        print(f"| {name} | {size:,} | {enc_s:.3f} | {dec_s:.3f} |")


if __name__ == "__main__":
    main()
