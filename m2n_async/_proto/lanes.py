"""The data-plane lanes as facts: their names, ``auto``'s order, bucket sizes, NCCL variables.

Theory of operation: three lanes move bytes (DESIGN §1) — ``m2n`` (NVIDIA ``nccl.m2n``
reshards), ``nccl`` (packed grouped send/recv) and ``gloo`` (CPU). What every layer must
agree on about them lives here, once, as data and one pure filter: the plan checks and the
cost model (``_proto``), the handshake that chooses a lane, the lanes themselves (``_data``),
the engine that cuts buckets, and ``m2n-async plan``. Whether a lane can carry a given plan
is a question about that plan: ``_proto.plan.carry_problem``.

Pure like the rest of ``_proto`` (it imports only the errors): the NCCL environment is
passed in, never read here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from m2n_async._proto.errors import PlanError

__all__ = [
    "AUTO",
    "DEFAULT_BUCKET_BYTES",
    "DIAGNOSTIC_NCCL_VARIABLES",
    "GPU_LANES",
    "LANES",
    "LANE_NAMES",
    "MATCHED_NCCL_VARIABLES",
    "PREFERENCE",
    "REQUESTABLE",
    "bucket_bytes",
    "check_lane",
    "nccl_environment",
]

#: Every lane, in ``transport="auto"``'s preference order (DESIGN §1): M2N is NVIDIA's own
#: resharding collective and the fastest path; the packed ``nccl`` exchange carries what M2N
#: cannot express; Gloo runs where there is no GPU.
LANES: Final[tuple[str, ...]] = ("m2n", "nccl", "gloo")
LANE_NAMES: Final[frozenset[str]] = frozenset(LANES)
#: The lanes that run on CUDA over an NCCL communicator.
GPU_LANES: Final[tuple[str, ...]] = ("m2n", "nccl")
#: What a configuration may request: a lane, or ``auto`` to let the handshake choose.
AUTO: Final[str] = "auto"
REQUESTABLE: Final[frozenset[str]] = LANE_NAMES | {AUTO}
#: The preference order as reasons and messages spell it.
PREFERENCE: Final[str] = " > ".join(LANES)

#: ``bucket_bytes`` when the configuration leaves it to the agreed lane (None).
DEFAULT_BUCKET_BYTES: Final[Mapping[str, int]] = {
    # On NVLink a bucket's fixed costs (submission, completion, loop wake-up) matter: 64 MiB
    # buckets made rounds 30-48 % slower than 256 MiB on dense models, 1 GiB gained nothing
    # (BENCHMARKS "Multi-GPU"); staging stays bounded by max_inflight x this.
    "m2n": 256 << 20,
    "nccl": 256 << 20,
    # CPU: large buckets only add memory; the per-bucket costs are small next to socket copies.
    "gloo": 64 << 20,
}


def bucket_bytes(lane: str, configured: int | None = None) -> int:
    """The bucket size a job on ``lane`` runs with: ``configured`` (``EngineConfig
    .bucket_bytes``, a plan file's) or else the lane's default. A pure function of agreed
    inputs, so every rank cuts the same buckets. ``PlanError`` for an unknown lane."""
    check_lane(lane)
    return DEFAULT_BUCKET_BYTES[lane] if configured is None else configured


def check_lane(name: str) -> None:
    """``PlanError`` unless ``name`` is one of ``LANES``."""
    if name not in LANE_NAMES:
        raise PlanError(f"unknown transport {name!r} (expected one of "
                        f"{', '.join(sorted(LANE_NAMES))})")


# NCCL M2N reads these only for logs and traces, so ranks may differ.
DIAGNOSTIC_NCCL_VARIABLES: Final[frozenset[str]] = frozenset({
    "NCCL_RESHARD_LOG_LEVEL", "NCCL_RESHARD_SPLIT_KERNEL_TRACE",
})
# Outside NCCL_RESHARD_*: a rank that enables multi-rank-per-GPU (or NVLS) while its peers do
# not fails communicator init, or hangs in it; cheaper to name the variable now.
MATCHED_NCCL_VARIABLES: Final[frozenset[str]] = frozenset({
    "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_NVLS_ENABLE",
})


def nccl_environment(environ: Mapping[str, str],
                     also: Iterable[str] = MATCHED_NCCL_VARIABLES) -> tuple[tuple[str, str], ...]:
    """The NCCL variables that must be equal on every rank, sorted ``(name, value)``.

    Every ``NCCL_RESHARD_*`` variable except the diagnostic ones, plus the names in ``also``.
    Takes the environment as an argument (the core reads no process state).
    """
    wanted = set(also)
    return tuple(sorted(
        (k, v) for k, v in environ.items()
        if (k.startswith("NCCL_RESHARD_") and k not in DIAGNOSTIC_NCCL_VARIABLES)
        or k in wanted))
