"""Engine configuration, lifecycle states and the per-round result.

Theory of operation: ``EngineConfig`` is the one bag of knobs a user touches; the engine maps
it onto the data plane's ``TransportSettings`` and the handshake's timeouts. The fields that
must agree between ranks (``transport``, ``bucket_bytes``, ``max_cta``) are compared in the
handshake — a rank configured differently fails preflight naming the field — so nothing
silently runs with mismatched bucket boundaries (which would hang a real collective).
``SyncResult`` is what every round returns on every rank.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from m2n_async._proto.cost import DEFAULT_LANES, cost_inputs
from m2n_async._proto.errors import PlanError
from m2n_async._proto.lanes import AUTO, LANES, REQUESTABLE
from m2n_async._proto.stacking import COALESCE_BELOW_BYTES

__all__ = ["EngineConfig", "EngineState", "SyncResult"]

#: ``SyncResult.summary()`` shows ``loop_stall_seconds`` from this fraction of the round's
#: ``seconds`` on (and at least ``_STALL_SHOWN_S``): a healthy loop's figure is a few
#: milliseconds at most (the engine's own steps on it, short GIL waits behind its copy
#: threads), a tenth of the round is something else in the process.
_STALL_SHOWN_FRACTION = 0.1
_STALL_SHOWN_S = 0.01


class EngineState(enum.Enum):
    """Lifecycle (DESIGN §6): PREFLIGHT → READY ⇄ UPDATING; READY or UPDATING → POISONED;
    any state → CLOSED.

    POISONED: no more rounds on this engine, until ``close`` and a new ``connect``: a round
    failed (or was cut short, also while this rank waited for its start), or the job ended
    (trainer rank 0 closed it or opened a newer generation) while a worker, or a trainer
    rank other than 0, waited for a round, though nothing failed then.
    """

    PREFLIGHT = "preflight"
    READY = "ready"
    UPDATING = "updating"
    POISONED = "poisoned"
    CLOSED = "closed"


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs. Defaults suit a CPU/Gloo job; every field is validated here.

    - ``transport``: ``"auto"`` (m2n > nccl > gloo: the best one every rank can run and that
      can express the plan), or ``"m2n"``, ``"nccl"``, ``"gloo"``. Must match on every rank.
    - ``bucket_bytes``: bytes of staging per bucket (per rank, both directions); bucket
      boundaries derive from it and the plan, so it must match on every rank. None (default):
      the agreed transport's default — 64 MiB for ``gloo``, 256 MiB for ``m2n``/``nccl``,
      where a bucket's fixed costs matter on NVLink (BENCHMARKS "Multi-GPU").
    - ``max_inflight``: buckets between pack and release at once (pack i+1 ‖ transfer i ‖
      unpack i-1 needs 3). Extra memory is bounded by ``max_inflight x bucket_bytes`` (a
      single parameter larger than ``bucket_bytes`` gets a bucket of its own).
    - ``max_cta``: M2N CTA limit (GPU); compared across ranks.
    - ``phase_timeout``: seconds per handshake phase (plus a per-parameter allowance), also
      the bound on communicator creation.
    - ``round_timeout``: seconds a round may take on any rank before it is aborted everywhere;
      trainer rank 0's value (or its ``sync_weights(timeout=)``) applies to every rank.
    - ``abort_grace``: seconds a failing round may spend telling its peers (abort record,
      outcome gather) before this rank gives up on them.
    - ``device``: "cpu" / "cuda" / "cuda:N" / None (transport default).
    - ``host``: address the CPU data plane binds (None: 127.0.0.1 for a loopback store).
    - ``job``: store namespace; engines of one job share it, different jobs may share a store.
    - ``link_bytes_per_second``: per-rank link bandwidth used for the plan's lower bound and
      ``SyncResult.efficiency`` (None: not computed).
    - ``coalesce``: on ``m2n``, stack the parameters of a bucket that share shape, dtype and
      both layouts into one reshard (``docs/tuning.md``, "Coalesced reshards"). Changes
      the calls on the wire, so it must match on every rank.
    - ``coalesce_below``: bytes; a parameter any rank moves at least this many bytes of stays
      a single zero-copy reshard (default 16 MiB). Must match on every rank.
    - ``costs``: per-transport cost terms ``{"m2n": (call_seconds, param_seconds,
      bytes_per_second), ...}`` that ``transport="auto"`` predicts each lane's round from
      (``docs/tuning.md``, "How auto chooses"); lanes left out keep the measured defaults.
      None: the ``M2N_ASYNC_COSTS`` environment variable (the same, as JSON), else the
      defaults. Must match on every rank (compared in the handshake).
    """

    transport: str = "auto"
    bucket_bytes: int | None = None
    max_inflight: int = 3
    max_cta: int | None = None
    phase_timeout: float = 60.0
    round_timeout: float = 300.0
    abort_grace: float = 5.0
    device: str | None = None
    host: str | None = None
    job: str = "m2n"
    link_bytes_per_second: float | None = None
    coalesce: bool = True
    coalesce_below: int = COALESCE_BELOW_BYTES
    costs: Mapping[str, tuple[float, float, float]] | None = None

    def __post_init__(self) -> None:
        if self.transport not in REQUESTABLE:
            *head, last = (AUTO, *LANES)
            raise PlanError(f"EngineConfig.transport must be {', '.join(map(repr, head))} or "
                            f"{last!r}, got {self.transport!r}")
        # Below 2**63: the handshake packs it as an int64 (a larger one would fail to encode
        # at connect, on this rank alone).
        if self.bucket_bytes is not None and (type(self.bucket_bytes) is not int
                                              or not 1 <= self.bucket_bytes < 2**63):
            raise PlanError(f"EngineConfig.bucket_bytes must be None or an int in "
                            f"[1, 2**63), got {self.bucket_bytes!r}")
        if type(self.max_inflight) is not int or self.max_inflight < 1:
            raise PlanError(f"EngineConfig.max_inflight must be an int >= 1, got "
                            f"{self.max_inflight!r}")
        if self.max_cta is not None and (type(self.max_cta) is not int or self.max_cta < 1):
            raise PlanError(f"EngineConfig.max_cta must be None or an int >= 1, got "
                            f"{self.max_cta!r}")
        for name in ("phase_timeout", "round_timeout", "abort_grace"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v > 0 and math.isfinite(v)):
                raise PlanError(f"EngineConfig.{name} must be a finite number of seconds > 0, "
                                f"got {v!r}")
        if not self.job or "/" in self.job:
            raise PlanError(f"EngineConfig.job must be non-empty without '/', got {self.job!r}")
        if type(self.coalesce) is not bool:
            raise PlanError(f"EngineConfig.coalesce must be a bool, got {self.coalesce!r}")
        if type(self.coalesce_below) is not int or self.coalesce_below < 1:
            raise PlanError(f"EngineConfig.coalesce_below must be an int >= 1 (bytes), got "
                            f"{self.coalesce_below!r}")
        if self.costs is not None:
            if not isinstance(self.costs, Mapping):
                raise PlanError(f"EngineConfig.costs must be None or a mapping transport -> "
                                f"(call_seconds, param_seconds, bytes_per_second), got "
                                f"{self.costs!r}")
            cost_inputs({**DEFAULT_LANES, **self.costs}, dict.fromkeys(DEFAULT_LANES, 1), 0)
        bps = self.link_bytes_per_second
        if bps is not None and not (isinstance(bps, int | float) and bps > 0):
            raise PlanError(f"EngineConfig.link_bytes_per_second must be None or > 0, got "
                            f"{bps!r}")


@dataclass(frozen=True)
class SyncResult:
    """The outcome of one committed round on this rank.

    ``bytes`` is what this rank sent (trainer) or received (worker) — checked equal to the
    plan's count, so a zero-byte "success" cannot happen. ``phases`` holds seconds of two
    kinds that must not be compared with each other. Wall time, one after the other:
    ``wait_start`` (until the round began here), ``pipeline`` (all buckets, start to end),
    ``commit`` (outcome gather); ``seconds`` is about their sum. Busy time, summed over the
    buckets: ``pack``, ``transfer``, ``unpack`` — buckets overlap (up to ``max_inflight``
    in flight), so each can exceed ``pipeline``: ``transfer`` 59.8 s against ``pipeline``
    20 s means about three buckets were in flight at a time, not that the wire was slow.
    ``summary()`` prints them labelled.
    ``efficiency`` is the plan's lower bound over ``seconds`` when
    ``EngineConfig.link_bytes_per_second`` is set. ``peak_extra_bytes`` is the peak staging
    held by the pipeline (≤ ``max_inflight x bucket_bytes``, plus the temporaries of casts
    that land at unaligned offsets: docs/tuning.md, "Casting while packing"). ``transport``
    is the agreed data plane and ``reason`` why it was chosen, followed by how it runs when it
    says more (``m2n``: grouped submission or ordered single reshards, and why).
    ``cast_bytes`` (trainer) is how many of ``bytes`` this rank produced by casting a source
    to the wire dtype while packing (fp32 master weights, bf16 on the wire); 0 when every
    source already had the wire dtype, and on a worker.
    ``loop_stall_seconds`` is how long this rank's event loop was not available to the
    engine during the round: a probe beside the round sleeps 10 ms at a time and sums how
    late it woke (each wake-up later than 2 ms, counted whole). A loop is late when a task
    runs synchronous work on it (a blocking call, ``bytes(t.untyped_storage())`` of a large
    tensor) or another thread of the process holds the GIL; the engine's own steps on that
    loop waited that long. Near 0 in a healthy round; ``summary()`` shows it once it is
    significant — at least a tenth of ``seconds`` and at least 10 ms — and
    ``docs/troubleshooting.md`` ("The event loop stalled") says how to read it.
    """

    version: int
    round: int
    generation: int
    bytes: int
    seconds: float
    phases: Mapping[str, float] = field(default_factory=dict)
    buckets: int = 0
    lower_bound_seconds: float | None = None
    efficiency: float | None = None
    peak_extra_bytes: int = 0
    transport: str = ""
    reason: str = ""
    cast_bytes: int = 0
    #: the round time ``_proto.cost`` predicted for this plan on this transport at connect
    predicted_seconds: float | None = None
    #: seconds this rank's event loop was not available to the engine during the round
    loop_stall_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Gigabytes (10^9) per second this rank moved in the round."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """A few readable lines: what moved, how fast, against the plan's lower bound, and
        where the time went (wall stages, then busy time summed over buckets)."""
        mb = self.bytes / 1e6
        head = (f"version {self.version} (round {self.round}, generation {self.generation}): "
                f"{mb:.1f} MB in {self.buckets} bucket(s), {self.seconds:.3f} s = "
                f"{self.gbps:.2f} GB/s over {self.transport or '?'}")
        lines = [head]
        if self.lower_bound_seconds is not None:
            eff = f" ({self.efficiency:.0%} of it)" if self.efficiency is not None else ""
            lines.append(f"  lower bound {self.lower_bound_seconds:.3f} s{eff}")
        if self.predicted_seconds is not None:
            lines.append(f"  predicted {self.predicted_seconds:.3f} s")
        wall = [(k, self.phases[k]) for k in ("wait_start", "pipeline", "commit")
                if k in self.phases]
        busy = [(k, v) for k, v in self.phases.items()
                if k not in ("wait_start", "pipeline", "commit")]
        if wall:
            lines.append("  wall: " + ", ".join(f"{k} {v:.3f} s" for k, v in wall))
        if busy:
            lines.append("  busy, summed over buckets (they overlap): "
                         + ", ".join(f"{k} {v:.3f} s" for k, v in busy))
        if self.peak_extra_bytes:
            lines.append(f"  peak staging {self.peak_extra_bytes / 1e6:.1f} MB"
                         + (f", cast {self.cast_bytes / 1e6:.1f} MB" if self.cast_bytes
                            else ""))
        if self.loop_stall_seconds >= max(_STALL_SHOWN_S,
                                          _STALL_SHOWN_FRACTION * self.seconds):
            share = self.loop_stall_seconds / self.seconds if self.seconds > 0 else 1.0
            lines.append(f"  event loop stalled {self.loop_stall_seconds:.3f} s "
                         f"({min(share, 1.0):.0%} of the round): blocking or GIL-heavy work "
                         f"in this process held up the engine (docs/troubleshooting.md)")
        return "\n".join(lines)
