"""Coalesced reshards: which parameters of a bucket travel as one stacked M2N call.

Theory of operation. M2N is one collective per tensor, and without GIN (``nccl.m2n.group()``
fails on such hosts) every call pays its fixed cost alone: about 0.6 ms with four ranks on one
H200 and 75-85 us between two H200s, while a (512, 256) bf16 expert moves in a few
microseconds of bandwidth. Parameters that share global shape, wire dtype, source layout and
destination layout are cut identically on every rank, so ``k`` of them are exactly one tensor
of shape ``(k, *shape)`` whose shard dims are shifted by one: the trainer packs its ``k``
local shards into one staging tensor, M2N moves it in one call, the worker scatters it back.
The same 256 MiB of MoE-like weights move 240x faster that way (BENCHMARKS "GPU sync").

What is stacked, and why:

* only parameters of tensor rank <= 2, so that the stacked tensor stays within M2N's rank 3;
* only within a bucket, so the staging stays inside the ``max_inflight x bucket_bytes`` bound
  and a bucket still means "the parameters ``[start, stop)``";
* only a parameter whose cost (the most bytes any rank moves for it, ``param_cost``) is below
  ``coalesce_below``: a larger one is bandwidth-bound alone, and a single call moves it
  zero-copy from the trainer's shard into the worker's target instead of through two copies.
  The default, 16 MiB, is where the copies start to cost more than the call they save: a call
  between H200s costs ~80 us, as much as HBM copies of ~80 MB on both sides, and a 16 MiB
  shard already runs a single call at >= 85 % of its bandwidth (BENCHMARKS "GPU sync",
  threshold sweep). Dense and large models therefore run exactly as without coalescing;
* at most ``max_call_bytes`` per rank per call (the 2 GiB PACK bin of M2N's default staging);
  a group that would exceed it is cut into consecutive stacks.

Every rank computes the stacks from the agreed plan, the agreed buckets and the two settings,
which the handshake compares (the data_plane identity: ``m2n_async.coalesce``), so every
rank issues the same calls in the same order — M2N hangs on a mismatch, it does not detect
it. Calls are ordered by their first parameter's position in the plan; the parameters of one
stack are in plan order, which is their index along the stack dim.

Pure functions of the plan: no torch, no I/O (the ``_proto`` rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from m2n_async._proto.plan import Bucket, TransferPlan

__all__ = [
    "COALESCE_BELOW_BYTES",
    "STACK_MAX_RANK",
    "bucket_calls",
    "stack_problem",
    "stacked_placement",
]

#: Default ``coalesce_below``: parameters any rank moves fewer bytes of are stacked.
COALESCE_BELOW_BYTES: Final[int] = 16 << 20
#: Highest tensor rank that can be stacked (the stacked tensor has one dim more; M2N takes 3).
STACK_MAX_RANK: Final[int] = 2


def stack_problem(plan: TransferPlan, i: int, coalesce_below: int) -> str | None:
    """Why parameter ``i`` travels alone, or None when it may be stacked."""
    p = plan.params[i]
    if coalesce_below <= 0:
        return "coalescing is off"
    if len(p.spec.shape) > STACK_MAX_RANK:
        return (f"tensor rank {len(p.spec.shape)} > {STACK_MAX_RANK} (the stack would exceed "
                f"M2N's rank 3)")
    cost = plan.param_cost(i)
    if cost >= coalesce_below:
        return f"moves {cost} bytes on one rank, >= coalesce_below {coalesce_below}"
    return None


def bucket_calls(plan: TransferPlan, bucket: Bucket, *, coalesce_below: int,
                 max_call_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The M2N calls of ``bucket``: per call, the plan indices it carries (one: a single
    reshard; several: one stacked reshard, in stack order).

    Identical on every rank for the same plan, bucket and settings. Every parameter of the
    bucket is in exactly one call; calls are sorted by their first parameter.
    """
    if max_call_bytes < 1:
        raise ValueError(f"max_call_bytes must be >= 1, got {max_call_bytes}")
    gids = plan._geo_index()
    # Per geometry, once: its cost, or -1 when it travels alone (10^5 params, ~10^2 keys).
    costs: dict[int, int] = {}
    calls: list[list[int]] = []
    open_: dict[int, tuple[int, int]] = {}  # geometry id -> (index into calls, bytes so far)
    for i in range(bucket.start, bucket.stop):
        gid = gids[i]
        cost = costs.get(gid)
        if cost is None:
            cost = -1 if stack_problem(plan, i, coalesce_below) else plan.param_cost(i)
            costs[gid] = cost
        if cost < 0:
            calls.append([i])
            continue
        slot = open_.get(gid)
        if slot is not None and slot[1] + cost <= max_call_bytes:
            calls[slot[0]].append(i)
            open_[gid] = (slot[0], slot[1] + cost)
        else:
            open_[gid] = (len(calls), cost)
            calls.append([i])
    return tuple(tuple(c) for c in calls)


def stacked_placement(placement: int) -> int:
    """A placement of a stacked tensor: a shard dim moves one to the right, a replicate
    (negative) stays."""
    return placement + 1 if placement >= 0 else placement
