"""The cost model ``transport="auto"`` chooses by: a predicted round time per data plane.

Theory of operation. A round on one lane costs, to first order,

    calls x call_seconds  +  params x param_seconds  +  busiest rank's bytes / bytes_per_second

* ``calls``: the native calls the lane issues — on ``m2n`` one per reshard, so it depends on
  coalescing (``_proto.stacking.bucket_calls``); on ``nccl`` and ``gloo`` one grouped
  exchange per bucket.
* ``param_seconds``: host work per parameter (lookups, checks, segment bookkeeping).
* ``bytes``: the most any one rank sends or receives over the plan (``plan.send_bytes`` /
  ``recv_bytes``), at the lane's per-rank rate.

It is a ranking, not a promise: the terms are medians of measurements (``DEFAULT_LANES``,
from BENCHMARKS "Multi-GPU" between two H200s), and a host can be calibrated with
``bench/gpu_sync_bench.py --threshold-sweep`` (per-call and per-byte terms of M2N) and the
engine/lane figures of the same bench, passed as ``EngineConfig.costs`` or the
``M2N_ASYNC_COSTS`` environment variable (JSON, see ``parse_costs``). The prediction is what
``SyncResult.predicted_seconds`` reports beside the measured time, so a miscalibrated host
shows.

Every rank sends its ``CostInputs`` in the handshake's ``destination`` phase; they must be
equal (a rank that differs is named), and the choice is computed from them and the agreed
plan by the pure handshake, identically everywhere. Pure functions: no torch, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Final, NamedTuple

import msgspec

from m2n_async._proto.errors import PlanError
from m2n_async._proto.lanes import LANE_NAMES, PREFERENCE
from m2n_async._proto.messages import CostInputs, LaneCost
from m2n_async._proto.plan import (
    M2N_MAX_CALL_BYTES,
    MAX_BUCKET_PARAMS,
    TransferPlan,
    split_buckets,
)
from m2n_async._proto.stacking import bucket_calls

__all__ = [
    "AUTO_MARGIN",
    "COSTS_ENV",
    "DEFAULT_LANES",
    "CostInputs",
    "LaneCost",
    "Prediction",
    "cost_inputs",
    "describe_terms",
    "m2n_round_calls",
    "parse_costs",
    "pick",
    "predict",
]

#: ``auto`` leaves the first usable transport of its preference order only for one predicted
#: this much faster: the model is a ranking from medians, and measured between two H200s the
#: m2n and nccl lanes came within 1.2x of each other on dense models (2+2: 3.86 vs 4.66 ms)
#: where the default terms put them 1.3x apart the other way. The cases the model exists for
#: differ by far more (1024 experts as single reshards vs one packed exchange: 2.2x).
AUTO_MARGIN: Final[float] = 1.5

#: Per-lane cost terms as JSON (``parse_costs``), for hosts calibrated once; the engine
#: reads it when ``EngineConfig.costs`` is None.
COSTS_ENV: Final[str] = "M2N_ASYNC_COSTS"

#: Measured between two H200s over NVLink (BENCHMARKS "Multi-GPU", one rank per GPU): an
#: M2N reshard costs ~75-85 us whatever its size and a large one runs at ~240 GB/s; the
#: packed ``nccl`` exchange moves a 256 MiB bucket of 1024 experts in ~39 ms, ~35 us per
#: parameter of packing; Gloo on loopback TCP moves ~2 GB/s (BENCHMARKS "CPU sync").
#: ``bucket_bytes`` here is a placeholder: ``cost_inputs`` puts each lane's real one.
DEFAULT_LANES: Final[Mapping[str, tuple[float, float, float]]] = {
    #        call_seconds, param_seconds, bytes_per_second
    "m2n": (80e-6, 1e-6, 240e9),
    "nccl": (150e-6, 35e-6, 240e9),
    "gloo": (1e-3, 5e-6, 2e9),
}


class Prediction(NamedTuple):
    """One lane's predicted round on the agreed plan."""

    lane: str
    seconds: float
    calls: int
    nbytes: int  # the busiest rank's bytes

    def describe(self) -> str:
        t = (f"{self.seconds * 1e3:.3g} ms" if self.seconds < 1 else f"{self.seconds:.3g} s")
        return f"{self.lane} {t} ({self.calls} calls)"


def cost_inputs(lanes: Mapping[str, tuple[float, float, float]],
                bucket_bytes: Mapping[str, int], coalesce_below: int) -> CostInputs:
    """Validated ``CostInputs`` from per-lane terms and each lane's bucket size; the values
    are checked by ``costs_problem``, as a peer's are."""
    out = []
    for lane in sorted(lanes):
        if lane not in LANE_NAMES:
            raise PlanError(f"cost terms for unknown transport {lane!r} (known: "
                            f"{', '.join(sorted(LANE_NAMES))})")
        terms = lanes[lane]
        if len(terms) != 3 or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                      for x in terms):
            raise PlanError(f"cost terms of {lane!r} must be three finite numbers >= 0 "
                            f"(call_seconds, param_seconds, bytes_per_second), got {terms!r}")
        out.append(LaneCost(lane, float(terms[0]), float(terms[1]), float(terms[2]),
                            int(bucket_bytes[lane])))
    costs = CostInputs(tuple(out), int(coalesce_below))
    problem = costs_problem(costs)
    if problem is not None:
        raise PlanError(f"cost terms: {problem}")
    return costs


def costs_problem(costs: CostInputs | None) -> str | None:
    """What makes a peer's ``CostInputs`` unusable (they decode from its envelope, so what
    ``cost_inputs`` refuses locally can still arrive), or None."""
    if costs is None:
        return None
    if costs.coalesce_below < 0:
        return f"coalesce_below {costs.coalesce_below} < 0"
    for c in costs.lanes:
        terms = (c.call_seconds, c.param_seconds, c.bytes_per_second)
        if c.lane not in LANE_NAMES:
            return f"unknown transport {c.lane!r}"
        if not all(math.isfinite(x) and x >= 0 for x in terms) or not c.bytes_per_second > 0:
            return (f"{c.lane}: cost terms {terms} (finite, >= 0, bytes_per_second > 0 "
                    f"expected)")
        if c.bucket_bytes < 1:
            return f"{c.lane}: bucket_bytes {c.bucket_bytes} < 1"
    return None


def parse_costs(text: str) -> dict[str, tuple[float, float, float]]:
    """Per-lane terms from JSON: ``{"m2n": [call_s, param_s, bytes_per_s], ...}``; lanes
    left out keep ``DEFAULT_LANES``. ``PlanError`` on anything else."""
    try:
        raw = msgspec.json.decode(text.encode(), type=dict[str, tuple[float, float, float]])
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise PlanError(f"cost terms must be JSON like {{\"m2n\": [8e-05, 1e-06, 2.4e+11]}} "
                        f"(call_seconds, param_seconds, bytes_per_second): {e}") from None
    merged = dict(DEFAULT_LANES)
    merged.update(raw)
    cost_inputs(merged, dict.fromkeys(merged, 1), 0)  # validates the numbers and names
    return merged


def describe_terms(terms: tuple[float, float, float]) -> str:
    """One lane's ``(call_seconds, param_seconds, bytes_per_second)`` for a message."""
    call, param, rate = terms
    return f"{call:g} s/call, {param:g} s/param, {rate:g} B/s"


def m2n_round_calls(plan: TransferPlan, bucket_bytes: int, coalesce_below: int
                    ) -> Iterator[tuple[int, tuple[int, ...]]]:
    """The ``m2n`` lane's reshard calls of one round, in order, as ``(bucket index, plan
    indices)``: the buckets the engine runs (``split_buckets`` at ``MAX_BUCKET_PARAMS``), each
    cut into calls by ``bucket_calls`` (``coalesce_below`` 0: one call per parameter)."""
    for b in split_buckets(plan, plan.buckets(bucket_bytes), MAX_BUCKET_PARAMS):
        for call in bucket_calls(plan, b, coalesce_below=coalesce_below,
                                 max_call_bytes=M2N_MAX_CALL_BYTES):
            yield b.index, call


def _calls(plan: TransferPlan, lane: str, bucket_bytes: int, coalesce_below: int) -> int:
    if lane != "m2n":
        return len(split_buckets(plan, plan.buckets(bucket_bytes), MAX_BUCKET_PARAMS))
    if coalesce_below <= 0:
        return len(plan.params)
    return sum(1 for _ in m2n_round_calls(plan, bucket_bytes, coalesce_below))


def predict(plan: TransferPlan, costs: CostInputs, lanes: Sequence[str] | None = None
            ) -> dict[str, Prediction]:
    """Predicted round time of ``plan`` per lane of ``costs`` (those in ``lanes``, if given)."""
    nbytes = max(max(plan.send_bytes(r), plan.recv_bytes(r)) for r in range(plan.world_size))
    out: dict[str, Prediction] = {}
    for c in costs.lanes:
        if lanes is not None and c.lane not in lanes:
            continue
        calls = _calls(plan, c.lane, c.bucket_bytes, costs.coalesce_below)
        seconds = (calls * c.call_seconds + len(plan.params) * c.param_seconds
                   + nbytes / c.bytes_per_second)
        out[c.lane] = Prediction(c.lane, seconds, calls, nbytes)
    return out


def pick(predicted: Mapping[str, Prediction], preference: Sequence[str]) -> tuple[str, str]:
    """``auto``'s lane among ``preference`` (usable lanes, best first) and why: the first
    one, unless another is predicted ``AUTO_MARGIN`` times faster. Lanes without a
    prediction are skipped; ``preference`` must hold at least one predicted lane."""
    cands = [t for t in preference if t in predicted]
    first = cands[0]
    cheapest = min(cands, key=lambda t: predicted[t].seconds)  # the first of equals
    if predicted[cheapest].seconds * AUTO_MARGIN < predicted[first].seconds:
        return cheapest, (f"predicted over {AUTO_MARGIN:g}x faster than {first!r}, the first "
                          f"of {PREFERENCE}")
    return first, (f"the first of {PREFERENCE}, as none is predicted {AUTO_MARGIN:g}x "
                   f"faster")
