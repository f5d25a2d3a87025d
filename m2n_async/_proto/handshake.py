"""The preflight handshake as a pure state machine (DESIGN §5).

Theory of operation: before any communicator exists, every rank walks the same phases —
``hello → source → destination → data_plane → runtime_ready → connected`` — and each phase is
one all-gather. ``TRANSITIONS`` is the one table of the machine; the driver
(``m2n_async._engine._preflight``) and the docs' diagram (``docs/phases.md``) both come from it.

Per phase the driver asks ``Handshake`` for this rank's envelope (``hello()``, ``source()``,
…); when that local step raises, it sends ``failure(exc)`` instead, because a rank that stays
silent would leave its peers waiting out a deadline for a diagnosis it already has. The driver
all-gathers the encoded envelopes and hands the bytes, indexed by rank, to ``receive()``, which
decodes and validates every one strictly (tag, exact field set, types, protocol version,
generation, rank slot, phase), then checks agreement. The diagnosis is computed from the
gathered bytes alone — never from this rank's own inputs — so every rank raises the *same*
``PreflightError(phase, {rank: message})``, naming each failing or disagreeing rank.

Who is named when ranks disagree: the value held by the most ranks is the reference and the
others are named; when the top count is tied, no value can be trusted and every holder is
named (with one trainer and one worker disagreeing, both). Facts already agreed in an earlier
phase (transport, plan digest) are compared exactly, so a deviation there names one rank.

Plans that differ (``source``: a trainer's specs; ``destination``: a worker's placements)
are located in two steps, so that the gathers stay O(params) and not O(ranks x params):
every envelope carries 4 bytes of digest per ``DIFF_CHUNK`` records, which point at the first
chunk where each disagreeing rank differs from its reference rank. ``receive`` then returns
the current phase with ``wants_records`` set instead of raising; the ranks all-gather once
more — ``records()``: one holder of each distinct version of each such chunk ships it, every
other rank an empty ``DiffRecords`` — and ``receive_records`` raises the phase's
``PreflightError`` naming, for each disagreeing rank, the first parameter that differs, the
fields that differ (name, dtype, shape, mesh, placements), the value of each and the ranks
holding it. Who ships what is computed from the first gather alone, so every rank expects the
same records and raises the same error. If that second gather fails (a peer lost, a
deadline), ``error`` still holds the phase's diagnosis from the chunk digests.

The machine is sans-IO like the rest of ``_proto``: no clocks, no event loop, no torch. Time
(deadlines) and liveness (lost peers) belong to the driver, which reports them with
``abandon(Event.TIMED_OUT | Event.PEER_LOST | Event.STORE_ERROR | Event.CANCELLED)``.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NoReturn, TypeAlias, TypeVar

import msgspec

from m2n_async._proto.cost import Prediction, costs_problem, describe_terms, pick, predict
from m2n_async._proto.errors import (
    LocalProtocolError,
    PlanError,
    PreflightError,
    RemoteProtocolError,
)
from m2n_async._proto.lanes import (
    AUTO,
    DEFAULT_BUCKET_BYTES,
    LANE_NAMES,
    LANES,
    PREFERENCE,
    REQUESTABLE,
)
from m2n_async._proto.layout import Layout, Mesh, show_placements
from m2n_async._proto.messages import (
    PROTO_VERSION,
    CommunicatorId,
    CostInputs,
    DataPlaneIdentity,
    DataPlaneReport,
    DestinationPlan,
    DiffRecords,
    Hello,
    PhaseFailure,
    RuntimeReady,
    SourcePlan,
)
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import (
    TransferPlan,
    carry_problem,
    complete_plan_digest,
    source_plan_digest,
    validate_source_specs,
)

__all__ = [
    "ENVELOPE_OF",
    "TRANSITIONS",
    "Event",
    "Handshake",
    "Phase",
    "PreflightPlan",
    "choose_transport",
    "communicator_id",
    "mermaid",
    "phases_doc",
    "placements_digest",
    "read_communicator_id",
]


class Phase(enum.Enum):
    """The handshake's phases; the value is the name errors and docs use."""

    HELLO = "hello"
    SOURCE = "source"
    DESTINATION = "destination"
    DATA_PLANE = "data_plane"
    RUNTIME_READY = "runtime_ready"
    CONNECTED = "connected"
    FAILED = "failed"


class Event(enum.Enum):
    """What ended a phase."""

    AGREED = "agreed"  # every envelope valid and in agreement
    REJECTED = "rejected"  # PreflightError: a local step failed, or an envelope was bad
    TIMED_OUT = "timed out"  # the phase deadline passed (driver)
    PEER_LOST = "peer lost"  # a rank's store session ended (driver)
    STORE_ERROR = "store error"  # this rank's store failed or refused a request (driver)
    CANCELLED = "cancelled"  # the caller cancelled (driver)


def _phase_row(next_phase: Phase) -> dict[Event, Phase]:
    return {Event.AGREED: next_phase, Event.REJECTED: Phase.FAILED,
            Event.TIMED_OUT: Phase.FAILED, Event.PEER_LOST: Phase.FAILED,
            Event.STORE_ERROR: Phase.FAILED, Event.CANCELLED: Phase.FAILED}


TRANSITIONS: Final[Mapping[Phase, Mapping[Event, Phase]]] = {
    Phase.HELLO: _phase_row(Phase.SOURCE),
    Phase.SOURCE: _phase_row(Phase.DESTINATION),
    Phase.DESTINATION: _phase_row(Phase.DATA_PLANE),
    Phase.DATA_PLANE: _phase_row(Phase.RUNTIME_READY),
    Phase.RUNTIME_READY: _phase_row(Phase.CONNECTED),
    Phase.CONNECTED: {},
    Phase.FAILED: {},
}
"""The one transition table: phase -> event -> next phase. Terminal phases map to ``{}``."""

ENVELOPE_OF: Final[Mapping[Phase, type[msgspec.Struct]]] = {
    Phase.HELLO: Hello,
    Phase.SOURCE: SourcePlan,
    Phase.DESTINATION: DestinationPlan,
    Phase.DATA_PLANE: DataPlaneReport,
    Phase.RUNTIME_READY: RuntimeReady,
}
"""The envelope each gathering phase carries (``PhaseFailure`` may replace any of them)."""

_PHASE_DOC: Final[Mapping[Phase, str]] = {
    Phase.HELLO: "protocol version, role, rank, world size, trainer ranks, requested "
                 "transport: one topology, every rank in its slot",
    Phase.SOURCE: "trainers' source-plan digests equal; trainer rank 0's shipped specs hash "
                  "to its digest and are valid on their layouts",
    Phase.DESTINATION: "workers' mesh dims and placements equal and valid on the worker mesh; "
                       "transport chosen from every rank's capabilities and the plan limits; "
                       "complete-plan digest fixed",
    Phase.DATA_PLANE: "transport, plan digest, libnccl version, max_cta and the NCCL variables "
                      "that must match are equal on every rank",
    Phase.RUNTIME_READY: "every rank prepared its local resources for the agreed plan",
    # The engine's failures there (``_Engine._connect_data_plane``): keep the two in step.
    Phase.CONNECTED: "all phases passed: the engine connects the agreed data plane (on `nccl` "
                     "and `m2n` every rank first checks the SHA-256 and generation of rank 0's "
                     "NCCL unique id), then every rank confirms it in a barrier. A rank whose "
                     "connect fails raises `PreflightError('connected', {rank: why})` naming "
                     "itself and leaves `why` as it goes, so the peers waiting for it raise "
                     "that same error at once (a rank killed while connecting leaves none: "
                     "`{rank: 'was lost while the … data plane connected …'}`); a step or the "
                     "barrier not done within `EngineConfig.phase_timeout` raises "
                     "`TimeoutError` (the barrier's names the ranks that did not confirm)",
    Phase.FAILED: "every rank raised the same PreflightError, TimeoutError or PeerLostError; "
                  "nothing of the data plane was created by the handshake",
}

# A PhaseFailure carries a local exception's text; bound it so one rank's huge message (a
# repr of a tensor, say) cannot bloat every rank's gather.
_MAX_ERROR_CHARS: Final[int] = 2000
_ROLES: Final[tuple[str, str]] = ("trainer", "worker")

_ENCODER: Final = msgspec.msgpack.Encoder()
_HandshakeEnvelope: TypeAlias = (Hello | SourcePlan | DestinationPlan | DataPlaneReport
                                 | RuntimeReady | PhaseFailure)
_DECODER: Final = msgspec.msgpack.Decoder(_HandshakeEnvelope)
_RECORDS_DECODER: Final = msgspec.msgpack.Decoder(DiffRecords | PhaseFailure)
_COMMUNICATOR_ID_DECODER: Final = msgspec.msgpack.Decoder(CommunicatorId)


class _Header(msgspec.Struct):
    """Lenient view of any envelope, to name a peer's protocol version before strict decoding
    fails on the fields that version does not share with ours."""

    proto_version: int | None = None


_HEADER_DECODER: Final = msgspec.msgpack.Decoder(_Header)
_HELLO_DECODER: Final = msgspec.msgpack.Decoder(Hello)


def _decode_hello(data: bytes, r: int) -> Hello | None:
    """Rank ``r``'s ``Hello`` if its bytes are one that a ``Handshake`` could have sent from
    that slot (its rank inside its own world), else None: only such a topology may decide how
    many envelopes a view needs (``Handshake.hello_settled``); ``receive`` names the rest."""
    try:
        env = _HELLO_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return env if env.rank == r and 0 <= r < env.world_size else None


@dataclass(frozen=True)
class PreflightPlan:
    """What ``destination`` fixed: the plan, its complete digest and the transport (with why)."""

    plan: TransferPlan
    digest: str
    transport: str
    reason: str
    #: the agreed transport's predicted round (``_proto.cost``); None without cost inputs
    predicted_seconds: float | None = None


#: Parameters per chunk digest (``chunk_digests``): when plans differ, the ranks exchange the
#: records of the first chunk of this many parameters that differs (module docstring).
#: 4 bytes per 16 parameters: 25 KB per trainer for 10^5 parameters.
DIFF_CHUNK: Final[int] = 16
#: After a plan disagreement the ranks exchange at most this many chunks (the first differing
#: one of each disagreeing rank), each from at most this many holders of distinct records:
#: the second gather stays ~1,000 records whatever the number of ranks; a rank whose chunk is
#: left out is told the run of parameters, as the chunk digests alone can tell.
_DIFF_MAX_CHUNKS: Final[int] = 8
_DIFF_MAX_VERSIONS: Final[int] = 8


@dataclass
class _Odd:
    """One disagreeing rank: its reference rank, the chunk where they first differ, and its
    diagnosis without the records (``head`` + ``known`` + ``coarse``)."""

    reference: int
    chunk: int
    head: str
    known: list[str]
    coarse: str


@dataclass
class _Disagreement:
    """A phase's plans differ where the chunk digests point; the records are still to come.

    ``chunks``/``counts``: per rank that was compared (trainers in ``source``, workers in
    ``destination``), its chunk digests and its number of records; ``wanted``: per rank, the
    chunks it ships; ``failures``: the phase's diagnosis without the records.
    """

    phase: Phase
    chunks: dict[int, bytes]
    counts: dict[int, int]
    odd: dict[int, _Odd] = field(default_factory=dict)
    wanted: dict[int, tuple[int, ...]] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)

    def version(self, rank: int, k: int) -> bytes:
        """Rank's digest of chunk ``k`` (empty if its records end before it)."""
        return self.chunks[rank][4 * k:4 * k + 4]

    def versions(self, k: int) -> dict[bytes, list[int]]:
        """The distinct versions of chunk ``k`` and their holders (ascending), most held
        first (ties: the lowest holder first)."""
        held: dict[bytes, list[int]] = {}
        for r in sorted(self.chunks):
            held.setdefault(self.version(r, k), []).append(r)
        return dict(sorted(held.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))

    def plan_wanted(self) -> None:
        """Which ranks ship which chunks: for each chunk some rank first differs in (the
        first ``_DIFF_MAX_CHUNKS``), the lowest holder of each of its most held versions."""
        wanted: dict[int, list[int]] = {}
        for k in sorted({o.chunk for o in self.odd.values()})[:_DIFF_MAX_CHUNKS]:
            for holders in list(self.versions(k).values())[:_DIFF_MAX_VERSIONS]:
                wanted.setdefault(holders[0], []).append(k)
        self.wanted = {r: tuple(ks) for r, ks in sorted(wanted.items())}

    def expected(self, rank: int, k: int) -> int:
        """How many records rank's chunk ``k`` holds."""
        return max(0, min(DIFF_CHUNK, self.counts[rank] - k * DIFF_CHUNK))


def chunk_digests(items: Sequence[object]) -> bytes:
    """4 bytes of SHA-256 per run of ``DIFF_CHUNK`` items (msgpack-encoded), concatenated."""
    out = bytearray()
    for a in range(0, len(items), DIFF_CHUNK):
        body = _ENCODER.encode(tuple(items[a:a + DIFF_CHUNK]))
        out += hashlib.sha256(b"m2n-chunk\0" + body).digest()[:4]
    return bytes(out)


def first_difference(mine: bytes | None, ref: bytes | None) -> int | None:
    """Index of the first item of the first chunk that differs (or that one side lacks),
    None when the chunk digests are equal or unknown."""
    if mine is None or ref is None or mine == ref:
        return None
    for k in range(0, min(len(mine), len(ref)), 4):
        if mine[k:k + 4] != ref[k:k + 4]:
            return (k // 4) * DIFF_CHUNK
    return (min(len(mine), len(ref)) // 4) * DIFF_CHUNK


def placements_digest(mesh_dims: tuple[int, int],
                      placements: Sequence[tuple[int, int] | None]) -> str:
    """Hex SHA-256 of a worker mesh and its per-parameter placements (in source-plan order)."""
    body = _ENCODER.encode((tuple(mesh_dims), tuple(placements)))
    return hashlib.sha256(b"m2n-placements\0" + body).hexdigest()


# -- connected: the communicator's unique id ------------------------------------------------
# It exists only after every phase passed, so no phase can compare it: rank 0 publishes it
# with its SHA-256 and the generation, and every rank checks both on receipt. Bytes damaged
# or replaced in the store then fail the connect naming rank 0, instead of NCCL joining a
# communicator that never forms (a hang until the connect deadline).


def communicator_id(generation: int, unique_id: bytes) -> bytes:
    """What rank 0 publishes for the ``connected`` phase: the encoded ``CommunicatorId`` of
    its NCCL unique id (the id, its SHA-256 and the generation)."""
    uid = bytes(unique_id)
    return _ENCODER.encode(CommunicatorId(PROTO_VERSION, generation,
                                          hashlib.sha256(uid).hexdigest(), uid))


def read_communicator_id(raw: bytes, generation: int) -> bytes:
    """The unique id in rank 0's ``communicator_id`` bytes, checked against its SHA-256, the
    protocol version and ``generation``; ``RemoteProtocolError`` naming rank 0 otherwise."""
    try:
        got = _COMMUNICATOR_ID_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RemoteProtocolError(f"phase 'connected' (generation {generation}): rank 0 sent "
                                  f"an invalid unique-id envelope: {exc}") from None
    if got.proto_version != PROTO_VERSION or got.generation != generation:
        raise RemoteProtocolError(
            f"phase 'connected' (generation {generation}): rank 0's unique id is of protocol "
            f"{got.proto_version}, generation {got.generation}; expected {PROTO_VERSION}, "
            f"{generation}")
    if hashlib.sha256(got.unique_id).hexdigest() != got.digest:
        raise RemoteProtocolError(f"phase 'connected' (generation {generation}): rank 0's "
                                  "unique id does not match its SHA-256 (corrupted)")
    return got.unique_id


_H = TypeVar("_H", bound=Hashable)


def _outliers(values: Mapping[int, _H], show: Callable[[object], str] = repr
              ) -> tuple[_H | None, dict[int, str]]:
    """The reference value (held by the most ranks) and, per other rank, how many hold it.

    Returns ``(reference, {rank: note})``; on a tie for the top count the reference is
    ``None`` and every rank is an outlier, because no value can be trusted.
    """
    counts = Counter(values.values())
    if len(counts) <= 1:
        return (next(iter(counts)) if counts else None), {}
    ranked = counts.most_common()
    top = ranked[0][1]
    if sum(1 for _, c in ranked if c == top) > 1:
        holders = {v: sorted(r for r, x in values.items() if x == v) for v in counts}
        summary = "; ".join(f"rank(s) {_short(rs)}: {show(v)}" for v, rs in holders.items())
        return None, {r: f"no majority ({summary})" for r in values}
    ref = ranked[0][0]
    holders_ref = sorted(r for r, x in values.items() if x == ref)
    return ref, {r: f"{top} rank(s) {_short(holders_ref)} have {show(ref)}"
                 for r, x in values.items() if x != ref}


def _show_costs(costs: object) -> str:
    if not isinstance(costs, CostInputs):
        return "none"
    lanes = ", ".join(f"{c.lane}: "
                      f"{describe_terms((c.call_seconds, c.param_seconds, c.bytes_per_second))}"
                      f", buckets {c.bucket_bytes}" for c in costs.lanes)
    return f"[{lanes}; coalesce below {costs.coalesce_below}]"


def _cost_fields(costs: object) -> dict[str, object]:
    """``costs`` as the settings a user sets: per lane ``bucket_bytes`` and the three cost
    terms (``EngineConfig.costs`` / ``M2N_ASYNC_COSTS``), and ``coalesce_below`` (0: off)."""
    if not isinstance(costs, CostInputs):
        return {"cost inputs": "none"}
    out: dict[str, object] = {}
    for c in costs.lanes:
        out[f"bucket_bytes on {c.lane}"] = c.bucket_bytes
        terms = (c.call_seconds, c.param_seconds, c.bytes_per_second)
        out[f"cost terms of {c.lane}"] = f"({describe_terms(terms)})"
    # 0 is how EngineConfig(coalesce=False) goes on the wire: named as the user set it
    below = costs.coalesce_below
    out["EngineConfig.coalesce / coalesce_below"] = (
        "coalesce=False" if below == 0 else f"coalesce=True, coalesce_below={below}")
    return out


def _bucket_setting(costs: object) -> str | None:
    """The ``EngineConfig.bucket_bytes`` that gives ``costs`` its lanes' bucket sizes: the
    one size they all have, or ``None`` when each has its transport's default; ``None`` (the
    Python value) when no one setting gives them (they came from elsewhere)."""
    if not isinstance(costs, CostInputs) or not costs.lanes:
        return None
    sizes = {c.lane: c.bucket_bytes for c in costs.lanes}
    default = all(DEFAULT_BUCKET_BYTES.get(lane) == n for lane, n in sizes.items())
    if len(set(sizes.values())) == 1:
        # The default of every lane here: left None or set to it, the sizes cannot tell.
        n = next(iter(sizes.values()))
        return f"{n} (the transports' default)" if default else str(n)
    if default:
        shown = ", ".join(f"{lane} {n}" for lane, n in sizes.items())
        return f"None (each transport's default: {shown})"
    return None


def _only_buckets_differ(mine: object, theirs: object) -> bool:
    """Whether two ranks' cost inputs differ in their bucket sizes alone, each side's given
    by one ``EngineConfig.bucket_bytes`` (``_bucket_setting``), over the same lanes."""
    if not (isinstance(mine, CostInputs) and isinstance(theirs, CostInputs)):
        return False
    a, b = _bucket_setting(mine), _bucket_setting(theirs)
    if a is None or b is None or a == b:
        return False
    return [(c.lane, c.call_seconds, c.param_seconds, c.bytes_per_second)
            for c in mine.lanes] == [(c.lane, c.call_seconds, c.param_seconds,
                                      c.bytes_per_second) for c in theirs.lanes] and (
        mine.coalesce_below == theirs.coalesce_below)


def _holders(costs: Mapping[int, object], value: object) -> str:
    """``"rank 2"`` or ``"ranks [0, 1]"``: the ranks whose cost inputs are ``value``."""
    ranks = sorted(r for r, v in costs.items() if v == value)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_short(ranks)}"


def _cost_difference(mine: object, theirs: object) -> str:
    """Which settings differ between two ranks' cost inputs, with both values; bucket sizes
    that one ``EngineConfig.bucket_bytes`` gives on each side are named as that setting."""
    a, b = _cost_fields(mine), _cost_fields(theirs)
    buckets = _bucket_setting(mine), _bucket_setting(theirs)
    one_setting = None not in buckets and buckets[0] != buckets[1] and (
        [k for k in a if k.startswith("bucket_bytes on ")]
        == [k for k in b if k.startswith("bucket_bytes on ")])
    diffs = []
    if one_setting:
        diffs.append(f"EngineConfig.bucket_bytes {buckets[0]} here, {buckets[1]} there")
    diffs += [f"{k} {a.get(k, 'absent')} here, {b.get(k, 'absent')} there"
              for k in {**a, **b} if a.get(k) != b.get(k)
              and not (one_setting and k.startswith("bucket_bytes on "))]
    return "; ".join(diffs) or "no setting"


def _costs_differ(rank: int, costs: Mapping[int, object], other: object, note: str) -> str:
    """Why ``rank``'s cost inputs are refused, against ``other`` (the majority's, or with
    none, the lowest other rank's): the user's ``EngineConfig.bucket_bytes`` with who holds
    which value when that setting is all that differs, else every differing setting and
    both sides' inputs. Built from what every rank gathered: the same text on every rank."""
    mine = costs[rank]
    if _only_buckets_differ(mine, other):
        return (f"EngineConfig.bucket_bytes: {_bucket_setting(mine)} on "
                f"{_holders(costs, mine)}, {_bucket_setting(other)} on "
                f"{_holders(costs, other)} (bucket boundaries derive from it: it must match "
                f"on every rank)")
    return (f"its cost inputs differ ({_cost_difference(mine, other)}; "
            f"EngineConfig.costs / M2N_ASYNC_COSTS, bucket_bytes and "
            f"coalesce settings must match on every rank): "
            f"{_show_costs(mine)}, but {note}")


def _short(ranks: Sequence[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return str(list(ranks))
    return f"[{', '.join(map(str, ranks[:limit]))}, … {len(ranks) - limit} more]"


def _add(failures: dict[int, str], rank: int, message: str) -> None:
    # The first diagnosis of a rank is its root cause; later ones would only be consequences.
    failures.setdefault(rank, message)


def choose_transport(plan: TransferPlan, requested: str,
                     capabilities: Mapping[int, Sequence[str]],
                     costs: CostInputs | None = None
                     ) -> tuple[str, str, Prediction | None] | dict[int, str]:
    """The transport for ``plan``, why, and its predicted round; or ``{rank: message}`` when
    none can be used.

    ``auto``: of the transports every rank can run and that can carry the whole plan
    (``plan.carry_problem``: dtypes, tensor rank, fan-in/out limits), the first in the order
    of ``lanes.LANES`` — unless another is predicted ``AUTO_MARGIN`` times faster
    (``_proto.cost.pick``), then the fastest; lanes without terms are not predicted; without
    ``costs``, the first. An explicit transport must be runnable on every rank (else the
    ranks that cannot are named) and carry the plan (else every rank is named, with the
    parameter: the plan is everybody's).
    """
    ranks = sorted(capabilities)

    def blocked(t: str) -> tuple[list[int], str | None]:
        lacking = [r for r in ranks if t not in capabilities[r]]
        if lacking:
            return lacking, None
        return [], carry_problem(plan, t)

    if requested == AUTO:
        notes: list[str] = []
        per_rank: dict[int, list[str]] = {}
        global_notes: list[str] = []
        usable: list[str] = []
        for t in LANES:
            lacking, problem = blocked(t)
            if not lacking and problem is None:
                usable.append(t)
                continue
            if lacking:
                notes.append(f"{t} is not available on rank(s) {_short(lacking)}")
                for r in lacking:
                    per_rank.setdefault(r, []).append(f"cannot run {t}")
            else:
                notes.append(f"{t} cannot carry the plan ({problem})")
                global_notes.append(f"{t} cannot carry the plan ({problem})")
        if usable:
            return _cheapest(plan, usable, costs, notes)
        failures: dict[int, str] = {}
        for r in ranks:
            parts = per_rank.get(r, []) + global_notes
            if parts:
                failures[r] = "transport 'auto' found none usable: " + "; ".join(parts)
        return failures
    lacking, problem = blocked(requested)
    if lacking:
        return {r: f"cannot run the requested transport {requested!r} (this rank can run: "
                   f"{list(capabilities[r])})" for r in lacking}
    if problem is not None:
        return {r: f"the requested transport {requested!r} cannot carry the plan: {problem}"
                for r in ranks}
    got = predict(plan, costs, (requested,)).get(requested) if costs is not None else None
    return (requested, f"requested {requested!r}; every rank can run it and it carries the plan",
            got)


def _cheapest(plan: TransferPlan, usable: Sequence[str], costs: CostInputs | None,
              notes: Sequence[str]) -> tuple[str, str, Prediction | None]:
    """``auto``'s pick among ``usable`` (in preference order) and the reason it gives."""
    extra = "; " + "; ".join(notes) if notes else ""
    predicted = predict(plan, costs, usable) if costs is not None else {}
    if not predicted:
        t = usable[0]
        return (t, f"auto chose {t!r}: the first of {PREFERENCE} that every rank can run "
                   f"and that can carry the whole plan{extra}", None)
    best, why = pick(predicted, usable)
    ranked = ", ".join(predicted[t].describe() for t in usable if t in predicted)
    return (best, f"auto chose {best!r}: {why} among the transports every rank can run and "
                  f"that can carry the whole plan ({ranked}){extra}", predicted[best])


class Handshake:
    """One rank's side of the preflight. Sans-IO: the driver moves the bytes.

    Use: per phase, build this rank's envelope with the phase's method (or ``failure(exc)``
    when that raised), ``encode()`` it, all-gather the bytes, and pass them to ``receive()``.
    ``receive`` returns the next phase or raises ``PreflightError``; ``abandon`` records a
    timeout, lost peer or cancellation. After ``CONNECTED``, ``plan`` holds the agreement.
    """

    def __init__(self, *, role: str, rank: int, world_size: int, trainer_ranks: int,
                 generation: int, transport: str, proto_version: int = PROTO_VERSION) -> None:
        for name, value in (("rank", rank), ("world_size", world_size),
                            ("trainer_ranks", trainer_ranks), ("generation", generation)):
            if type(value) is not int:
                raise TypeError(f"Handshake {name} must be an int, got {value!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.trainer_ranks = trainer_ranks
        self.generation = generation
        self.transport = transport
        self.proto_version = proto_version
        self.phase = Phase.HELLO
        self.error: PreflightError | None = None
        self._specs: tuple[ParamSpec, ...] | None = None
        self._requested = transport  # replaced by the agreed request when hello passes
        self.plan: PreflightPlan | None = None
        self.identities: dict[int, DataPlaneIdentity] = {}
        # this rank's own records, which it may be asked to ship after a disagreement
        self._own_specs: tuple[ParamSpec, ...] = ()
        self._own_placements: tuple[tuple[int, int] | None, ...] = ()
        self._disagreement: _Disagreement | None = None  # found by the current phase's check
        self._awaiting: _Disagreement | None = None  # receive() asked for records
        self._view = tuple(range(world_size))  # the ranks the current phase's check compares

    # -- local steps: this rank's envelope for the current phase ------------------------

    def hello(self) -> Hello:
        """This rank's ``hello`` envelope: the topology it was started with."""
        self._expect(Phase.HELLO)
        return Hello(self.proto_version, self.generation, self.rank, self.role,
                     self.world_size, self.trainer_ranks, self.transport)

    def source(self, params: Sequence[ParamSpec] | None) -> SourcePlan:
        """This rank's ``source`` envelope. Trainers pass their specs; workers ``None``.

        Raises ``PlanError`` when a trainer's specs are invalid on the trainer mesh.
        """
        self._expect(Phase.SOURCE)
        if self.role != "trainer":
            return SourcePlan(self.proto_version, self.generation, self.rank, None, None,
                              None, None)
        if params is None:
            raise PlanError(f"trainer rank {self.rank} was given no source params")
        specs = tuple(params)
        validate_source_specs(specs, self.trainer_ranks)
        digest = source_plan_digest(specs, self.trainer_ranks)
        self._own_specs = specs
        return SourcePlan(self.proto_version, self.generation, self.rank, digest,
                          specs if self.rank == 0 else None, chunk_digests(specs), len(specs))

    def destination(self, capabilities: Sequence[str], mesh_dims: tuple[int, int] | None,
                    dst_placements: Mapping[str, tuple[int, int] | None] | None,
                    costs: CostInputs | None = None) -> DestinationPlan:
        """This rank's ``destination`` envelope. Workers pass their mesh dims and placements;
        every rank its ``costs`` (what ``auto`` predicts from; None: preference order).

        Raises ``PlanError`` when a worker's placements do not name exactly the source plan's
        parameters (the message lists the missing and the unexpected names).
        """
        self._expect(Phase.DESTINATION)
        caps = tuple(capabilities)
        if not all(isinstance(c, str) for c in caps):
            raise TypeError(f"capabilities must be transport names, got {caps!r}")
        if self.role != "worker":
            return DestinationPlan(self.proto_version, self.generation, self.rank, caps,
                                   None, None, None, None, costs)
        specs = self._agreed_specs()
        if mesh_dims is None or dst_placements is None:
            raise PlanError(f"worker rank {self.rank} was given no mesh_dims or "
                            f"dst_placements")
        if not isinstance(mesh_dims, tuple | list):  # tuple() of it would not say what it is
            raise PlanError(f"worker rank {self.rank}: mesh_dims must be two positive ints "
                            f"(replicas, tp), got {mesh_dims!r}")
        dims = Mesh(tuple(mesh_dims)).dims  # type: ignore[arg-type]  # validates two ints > 0
        names = [s.name for s in specs]
        missing = [n for n in names if n not in dst_placements]
        known = set(names)
        extra = sorted(n for n in dst_placements if n not in known)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"no destination placements for {len(missing)} param(s) the "
                             f"trainers send: {_names(missing)}")
            if extra:
                parts.append(f"placements for {len(extra)} param(s) the trainers do not "
                             f"send: {_names(extra)}")
            raise PlanError(f"worker rank {self.rank}: " + "; ".join(parts))
        placements = tuple(_placement(n, dst_placements[n]) for n in names)
        digest = placements_digest(dims, placements)
        self._own_placements = placements
        first_worker = self.rank == self.trainer_ranks
        return DestinationPlan(self.proto_version, self.generation, self.rank, caps, dims,
                               digest, placements if first_worker else None,
                               chunk_digests(placements), costs)

    def data_plane(self, identity: DataPlaneIdentity) -> DataPlaneReport:
        """This rank's ``data_plane`` envelope for the agreed transport and plan."""
        self._expect(Phase.DATA_PLANE)
        plan = self._agreed_plan()
        if not isinstance(identity, DataPlaneIdentity):
            raise TypeError(f"data_plane_identity must return a DataPlaneIdentity, got "
                            f"{type(identity).__name__}")
        env = tuple(sorted((str(k), str(v)) for k, v in identity.env))
        identity = msgspec.structs.replace(identity, env=env)
        return DataPlaneReport(self.proto_version, self.generation, self.rank, plan.transport,
                               plan.digest, identity)

    def runtime_ready(self) -> RuntimeReady:
        """This rank's ``runtime_ready`` envelope (after its local preparation succeeded)."""
        self._expect(Phase.RUNTIME_READY)
        plan = self._agreed_plan()
        return RuntimeReady(self.proto_version, self.generation, self.rank, plan.transport,
                            plan.digest)

    def failure(self, error: BaseException | str) -> PhaseFailure:
        """The envelope a rank sends instead when its local step raised ``error``."""
        if self.phase not in ENVELOPE_OF:
            raise LocalProtocolError(f"no phase to report a failure for: handshake is "
                                     f"{self.phase.value}")
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if len(text) > _MAX_ERROR_CHARS:
            text = text[:_MAX_ERROR_CHARS] + f"… ({len(text) - _MAX_ERROR_CHARS} more chars)"
        return PhaseFailure(self.proto_version, self.generation, self.rank, self.phase.value,
                            text)

    @staticmethod
    def encode(envelope: msgspec.Struct) -> bytes:
        """Wire bytes of an envelope (msgpack; its class name travels as the tag)."""
        return _ENCODER.encode(envelope)

    # -- the gathered phase ---------------------------------------------------------------

    def hello_settled(self, present: Mapping[int, bytes]) -> bool:
        """Whether the ``hello`` envelopes gathered so far (key index -> bytes) are the view
        to decide on.

        A rank started with the wrong ``world_size`` gathers a different number of keys from
        its peers: one that waits for more than exist would sit out the deadline, one that
        waits for fewer would decide on a part of the view. So the view decides, not this
        rank's own count. While every envelope present agrees with this rank's topology, it
        is settled only when it holds exactly ranks ``0 .. world_size-1`` (an agreeing rank
        never decides on a partial view). Once the envelopes show two topologies, it is
        settled when it holds every rank the reference topology implies (the one most ranks
        hold; on a tie the smallest world among the tied, the only one sure to exist): that
        is the view the ranks with the reference topology decide on, so every rank compares
        the same envelopes and raises the same text. An index beyond a world is an envelope
        of another topology, like any other.
        """
        world, _ = self._hello_reference(present)
        return all(r in present for r in range(world))

    def hello_missing(self, present: Mapping[int, bytes]) -> tuple[list[int], str | None]:
        """For a ``hello`` that timed out with ``present`` gathered: the ranks its view still
        waits for (those of the reference topology, as ``hello_settled`` reads it, not yet
        present), and when the envelopes show two topologies, what each rank said (the
        same text on every rank that reads the same envelopes: a majority started with too
        big a world waits for a rank that never comes, and only the minority knew better).
        """
        world, topologies = self._hello_reference(present)
        missing = [r for r in range(world) if r not in present]
        if len(set(topologies.values())) < 2:
            return missing, None
        by: dict[tuple[int, int], list[int]] = {}
        for r, topology in sorted(topologies.items()):
            by.setdefault(topology, []).append(r)
        said = "; ".join(f"rank(s) {_short(rs)} were started with world_size={w}, "
                         f"trainer_ranks={t}"
                         for (w, t), rs in sorted(by.items(), key=lambda kv: kv[1]))
        return missing, f"the ranks present disagree on the topology: {said}"

    def _hello_reference(self, present: Mapping[int, bytes]
                         ) -> tuple[int, dict[int, tuple[int, int]]]:
        """The world ``hello_settled`` waits for, and the topology each decodable envelope
        of this generation gives."""
        topologies: dict[int, tuple[int, int]] = {}
        for r, data in present.items():
            env = _decode_hello(data, r)
            if env is not None and (env.proto_version, env.generation) == (
                    self.proto_version, self.generation):
                topologies[r] = (env.world_size, env.trainer_ranks)
        own = (self.world_size, self.trainer_ranks)
        world = self.world_size
        if any(r >= world for r in present) or any(t != own for t in topologies.values()):
            counts = Counter(topologies.values()).most_common()
            # With no topology to go by (an index beyond this world whose envelope does not
            # decode), this world's own ranks are still the ones to decide on.
            if counts:
                top = counts[0][1]
                world = min(w for (w, _), c in counts if c == top)
        return world, topologies

    def receive(self, payloads: Sequence[bytes] | Mapping[int, bytes]) -> Phase:
        """Validate the gathered envelopes of the current phase (index = rank) and advance.

        Returns the next phase. Raises ``PreflightError`` (and moves to ``FAILED``) naming
        every rank whose local step failed, whose envelope was invalid, or that disagreed —
        except when plans differ where the chunk digests point: then it returns the current
        phase with ``wants_records`` set (``error`` holds the diagnosis so far), and the
        driver gathers ``records()`` for ``receive_records``, which raises the final error.

        ``hello`` also takes a view by key index: the one ``ControlGroup.all_gather_open``
        returns, settled by ``hello_settled`` on the rank that recorded it and the same on
        every rank. The ranks compared are the view's, which need not be ``0 ..
        world_size-1`` when the topologies differ (so a rank started with the wrong world
        raises its peers' text). A view that lacks this rank (its peers decided without it)
        refuses it, named as not in the group.
        """
        phase = self.phase
        if phase not in ENVELOPE_OF:
            raise LocalProtocolError(f"handshake is {phase.value}; it gathers nothing more")
        if self._awaiting is not None:
            raise LocalProtocolError(f"phase {phase.value!r} waits for the records of a plan "
                                     f"disagreement (receive_records), not for envelopes")
        if isinstance(payloads, Mapping):
            # The view the group recorded (``all_gather_open``): settled by the rank that
            # recorded it, and the same on every rank, so it is not settled again here: a
            # rank's own rule may disagree with a view it did not record (every envelope a
            # failure, so no topology to go by; a view without this rank, decided before
            # its envelope landed, which then refuses it in _check_hello).
            if phase is not Phase.HELLO:
                raise LocalProtocolError(f"phase {phase.value!r} gathers a list of "
                                         f"world_size envelopes, not a view by key index")
            view = dict(sorted(payloads.items()))
        elif len(payloads) != self.world_size:
            raise LocalProtocolError(f"phase {phase.value!r}: got {len(payloads)} envelopes "
                                     f"for world_size {self.world_size}")
        else:
            view = dict(enumerate(payloads))
        self._disagreement = None
        failures: dict[int, str] = {}
        envelopes: dict[int, msgspec.Struct] = {}
        self._view = tuple(view)
        for r, data in view.items():
            decoded = self._decode(phase, r, data)
            if isinstance(decoded, str):
                failures[r] = decoded
            elif isinstance(decoded, PhaseFailure):
                failures[r] = f"local step failed: {decoded.error}"
            else:
                envelopes[r] = decoded
        # The agreement checks run on the valid envelopes even when some ranks failed, so one
        # error lists every problem of the phase instead of one per attempt.
        checks: dict[Phase, Callable[[dict[int, msgspec.Struct], dict[int, str]], None]] = {
            Phase.HELLO: self._check_hello,
            Phase.SOURCE: self._check_source,
            Phase.DESTINATION: self._check_destination,
            Phase.DATA_PLANE: self._check_data_plane,
            Phase.RUNTIME_READY: self._check_runtime_ready,
        }
        checks[phase](envelopes, failures)
        if failures:
            self.error = PreflightError(phase.value, failures, generation=self.generation)
            found = self._disagreement
            if found is not None and found.wanted:
                found.failures = failures
                self._awaiting = found
                return phase
            self.phase = TRANSITIONS[phase][Event.REJECTED]
            raise self.error
        self.phase = TRANSITIONS[phase][Event.AGREED]
        return self.phase

    @property
    def wants_records(self) -> bool:
        """Whether the current phase failed on plans that differ and waits for the records
        (``records()`` all-gathered, then ``receive_records``) before it raises."""
        return self._awaiting is not None

    def records(self) -> DiffRecords:
        """This rank's ``DiffRecords``: the chunks of its specs (``source``) or placements
        (``destination``) that every rank computed it must ship; empty if none."""
        pending = self._pending_records()
        ks = pending.wanted.get(self.rank, ())
        cut = [slice(k * DIFF_CHUNK, (k + 1) * DIFF_CHUNK) for k in ks]
        if pending.phase is Phase.SOURCE:
            return DiffRecords(self.proto_version, self.generation, self.rank,
                               pending.phase.value, ks,
                               tuple(self._own_specs[c] for c in cut), ())
        return DiffRecords(self.proto_version, self.generation, self.rank, pending.phase.value,
                           ks, (), tuple(self._own_placements[c] for c in cut))

    def receive_records(self, payloads: Sequence[bytes]) -> NoReturn:
        """Validate the gathered ``DiffRecords`` (index = rank) and raise the phase's
        ``PreflightError``: each disagreeing rank is told the first parameter where it differs
        from its reference rank, the fields that differ there, and which ranks hold each
        value. A rank whose records are missing or do not match its chunk digests is named;
        the ranks its records would have explained keep the chunk-digest diagnosis."""
        pending = self._pending_records()
        if len(payloads) != self.world_size:
            raise LocalProtocolError(f"phase {pending.phase.value!r}: got {len(payloads)} "
                                     f"record envelopes for world_size {self.world_size}")
        shipped: dict[tuple[int, int], tuple[object, ...]] = {}
        failures = dict(pending.failures)
        for r, data in enumerate(payloads):
            got = self._decode_records(pending, r, data)
            if isinstance(got, str):
                if r in pending.wanted:
                    _add(failures, r, got)
                continue
            chunks = got.specs if pending.phase is Phase.SOURCE else got.placements
            for k, recs in zip(got.chunks, chunks, strict=True):
                shipped[(r, k)] = recs
        for r, odd in pending.odd.items():
            detail = self._first_difference_text(pending, shipped, r, odd)
            if detail is not None:
                failures[r] = _compose(odd.head, [*odd.known, detail])
        self._awaiting = None
        self.error = PreflightError(pending.phase.value, failures, generation=self.generation)
        self.phase = TRANSITIONS[pending.phase][Event.REJECTED]
        raise self.error

    def abandon(self, event: Event) -> Phase:
        """Record that the current phase ended without agreement (timeout, lost peer, cancel);
        during a records exchange ``error`` keeps the diagnosis of the chunk digests."""
        if event is Event.AGREED:
            raise LocalProtocolError("abandon() takes a failure event, not AGREED")
        self._awaiting = None
        nxt = TRANSITIONS[self.phase].get(event)
        if nxt is not None:
            self.phase = nxt
        return self.phase

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self, phase: Phase, r: int, data: bytes) -> msgspec.Struct | str:
        """The rank's valid envelope, or why it is not one."""
        try:
            header = _HEADER_DECODER.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return f"sent bytes that are not a handshake envelope ({e})"
        if header.proto_version != self.proto_version:
            return (f"speaks protocol version {header.proto_version}; this handshake is "
                    f"protocol version {self.proto_version}")
        try:
            env = _DECODER.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return f"sent an invalid envelope: {e}"
        expected = ENVELOPE_OF[phase]
        if not isinstance(env, (expected, PhaseFailure)):
            return (f"sent {type(env).__name__} during phase {phase.value!r} (expected "
                    f"{expected.__name__} or PhaseFailure)")
        if env.generation != self.generation:
            age = "stale " if env.generation < self.generation else ""
            return (f"sent an envelope of {age}generation {env.generation}; this handshake "
                    f"is generation {self.generation}")
        if env.rank != r:
            return f"envelope claims rank {env.rank} but arrived in rank {r}'s slot"
        if isinstance(env, PhaseFailure) and env.phase != phase.value:
            return (f"reported a failure of phase {env.phase!r} during phase "
                    f"{phase.value!r}")
        return env

    def _decode_records(self, pending: _Disagreement, r: int, data: bytes
                        ) -> DiffRecords | str:
        """Rank ``r``'s valid records, or why they are not."""
        phase = pending.phase.value
        try:
            got = _RECORDS_DECODER.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return f"sent invalid plan records after phase {phase!r}: {e}"
        if (got.proto_version, got.generation, got.rank, got.phase) != (
                self.proto_version, self.generation, r, phase):
            return (f"sent plan records of protocol {got.proto_version}, generation "
                    f"{got.generation}, rank {got.rank}, phase {got.phase!r}; expected "
                    f"{self.proto_version}, {self.generation}, {r}, {phase!r}")
        if isinstance(got, PhaseFailure):
            return f"could not send its plan records: {got.error}"
        wanted = pending.wanted.get(r, ())
        chunks = got.specs if pending.phase is Phase.SOURCE else got.placements
        other = got.placements if pending.phase is Phase.SOURCE else got.specs
        if got.chunks != wanted or len(chunks) != len(wanted) or other:
            return (f"sent plan records of chunks {list(got.chunks)}, but chunks "
                    f"{list(wanted)} were asked of it")
        for k, recs in zip(wanted, chunks, strict=True):
            expected = pending.expected(r, k)
            if len(recs) != expected or (expected and
                                         chunk_digests(recs) != pending.version(r, k)):
                return (f"sent plan records of parameters #{k * DIFF_CHUNK}.."
                        f"#{(k + 1) * DIFF_CHUNK - 1} that do not match its chunk digests")
        return got

    # -- agreement per phase -----------------------------------------------------------------

    def _check_hello(self, envs: Mapping[int, msgspec.Struct], failures: dict[int, str]
                     ) -> None:
        hellos = {r: e for r, e in envs.items() if isinstance(e, Hello)}
        for r, h in hellos.items():
            if h.role not in _ROLES:
                _add(failures, r, f"role {h.role!r} is neither 'trainer' nor 'worker'")
            if h.transport not in REQUESTABLE:
                _add(failures, r, f"requested transport {h.transport!r} is not one of "
                                  f"{sorted(REQUESTABLE)}")
        topo, odd = _outliers({r: (h.world_size, h.trainer_ranks) for r, h in hellos.items()})
        for r, note in odd.items():
            h = hellos[r]
            _add(failures, r, f"topology world_size={h.world_size}, trainer_ranks="
                              f"{h.trainer_ranks} differs: {note}")
        if self.rank not in self._view:
            _add(failures, self.rank,
                 f"rank {self.rank} (started with world_size={self.world_size}, trainer_ranks="
                 f"{self.trainer_ranks}) is not in the group: ranks {list(self._view)} agreed "
                 f"on hello without it")
        if topo is not None:
            world, trainers = topo
            # The ranks compared, not this rank's own world_size: a rank started with another
            # one compares the same view as its peers and must derive the same text.
            size = sum(1 for r in self._view if r < world)
            for r in self._view:
                if r >= world:
                    _add(failures, r, f"rank {r} is outside topology world_size={world}")
            if world != size or not 1 <= trainers < world:
                for r in hellos:
                    _add(failures, r, f"topology world_size={world}, trainer_ranks={trainers} "
                                      f"is impossible for a group of {size} ranks "
                                      f"(need 1 <= trainer_ranks < world_size)")
            else:
                for r, h in hellos.items():
                    want = "trainer" if r < trainers else "worker"
                    if h.role in _ROLES and h.role != want:
                        _add(failures, r, f"rank {r} says it is a {h.role}, but ranks "
                                          f"[0, {trainers}) are trainers")
        requested, odd = _outliers({r: h.transport for r, h in hellos.items()})
        for r, note in odd.items():
            _add(failures, r, f"requested transport {hellos[r].transport!r} differs: {note}")
        if requested is not None:
            self._requested = requested

    def _check_source(self, envs: Mapping[int, msgspec.Struct], failures: dict[int, str]
                      ) -> None:
        t = self.trainer_ranks
        plans = {r: e for r, e in envs.items() if isinstance(e, SourcePlan)}
        for r, p in plans.items():
            if r >= t and (p.digest is not None or p.params is not None):
                _add(failures, r, "a worker sent a source digest or specs (workers have no "
                                  "source plan; both must be None)")
            elif r < t and not p.digest:
                _add(failures, r, "a trainer sent no source-plan digest")
            elif 0 < r < t and p.params is not None:
                _add(failures, r, "only trainer rank 0 ships the source specs")
            elif r == 0 and p.params is None:
                _add(failures, r, "trainer rank 0 did not ship the source specs")
        digests = {r: p.digest for r, p in plans.items()
                   if r < t and p.digest and r not in failures}
        ref_digest, odd = _outliers(digests, _show_digest)
        found = _Disagreement(Phase.SOURCE, {r: plans[r].chunks or b"" for r in digests},
                              {r: plans[r].n_params or 0 for r in digests})
        for r, note in odd.items():
            head = f"source-plan digest {_dig(digests[r])} differs: {note}"
            located = self._where_specs_differ(plans, digests, ref_digest, r)
            if located is None:
                _add(failures, r, _compose(head, ["different param names, dtypes, shapes, "
                                                  "layouts or order"]))
                continue
            located.head = head
            found.odd[r] = located
            _add(failures, r, _compose(head, [*located.known, located.coarse]))
        found.plan_wanted()
        self._disagreement = found
        root = plans.get(0)
        if root is None or root.params is None or 0 in failures:
            return
        try:
            validate_source_specs(root.params, t)
            shipped = source_plan_digest(root.params, t)
        except PlanError as e:
            _add(failures, 0, f"shipped source specs are invalid: {e}")
            return
        if shipped != root.digest:
            _add(failures, 0, f"shipped source specs hash to {_dig(shipped)}, not to its "
                              f"announced digest {_dig(root.digest)}")
            return
        self._specs = root.params

    def _check_destination(self, envs: Mapping[int, msgspec.Struct],
                           failures: dict[int, str]) -> None:
        t = self.trainer_ranks
        dests = {r: e for r, e in envs.items() if isinstance(e, DestinationPlan)}
        specs = self._agreed_specs()
        for r, d in dests.items():
            unknown = [c for c in d.capabilities if c not in LANE_NAMES]
            if unknown or len(set(d.capabilities)) != len(d.capabilities):
                _add(failures, r, f"capabilities {list(d.capabilities)} must be distinct names "
                                  f"from {sorted(LANE_NAMES)}")
            if r < t:
                if (d.mesh_dims, d.placements_digest, d.placements) != (None, None, None):
                    _add(failures, r, "a trainer sent destination placements (only workers "
                                      "have a destination side)")
                continue
            if d.mesh_dims is None or d.placements_digest is None:
                _add(failures, r, "a worker sent no mesh dims or placements digest")
            elif r == t and d.placements is None:
                _add(failures, r, "the first worker did not ship its placements")
            elif r != t and d.placements is not None:
                _add(failures, r, "only the first worker ships the placements")
        # auto's choice is computed from these, so they must be valid and the same everywhere
        for r, d in dests.items():
            problem = costs_problem(d.costs)
            if problem is not None and r not in failures:
                _add(failures, r, f"its cost inputs are invalid: {problem}")
        costs = {r: d.costs for r, d in dests.items() if r not in failures}
        ref_costs, odd_costs = _outliers(costs, _show_costs)
        for r, note in odd_costs.items():
            # what differs first, against the majority (or, with none, the lowest other rank)
            other = ref_costs if ref_costs is not None else next(
                v for q, v in sorted(costs.items()) if q != r)
            _add(failures, r, _costs_differ(r, costs, other, note))
        workers = {r: (d.mesh_dims, d.placements_digest) for r, d in dests.items()
                   if r >= t and r not in failures}
        ref, odd = _outliers(workers, _show_destination)
        found = _Disagreement(Phase.DESTINATION,
                              {r: dests[r].placement_chunks or b"" for r in workers},
                              dict.fromkeys(workers, len(specs)))
        for r, note in odd.items():
            head = f"destination {_show_destination(workers[r])} differs: {note}"
            located = self._where_placements_differ(dests, workers, ref, r)
            if located is None or located.chunk < 0:
                known = located.known if located is not None else []
                _add(failures, r, _compose(head, known))
                continue
            located.head = head
            found.odd[r] = located
            _add(failures, r, _compose(head, [*located.known, located.coarse]))
        found.plan_wanted()
        self._disagreement = found
        first = dests.get(t)
        if failures or first is None or ref is None:
            return
        dims, dig = ref
        assert dims is not None and first.placements is not None
        worker_ranks = list(range(t, self.world_size))
        if len(first.placements) != len(specs):
            _add(failures, t, f"shipped {len(first.placements)} placements for a source plan "
                              f"of {len(specs)} params")
            return
        if placements_digest(dims, first.placements) != dig:
            _add(failures, t, "shipped placements do not hash to its announced digest")
            return
        if dims[0] * dims[1] != len(worker_ranks):
            for r in worker_ranks:
                _add(failures, r, f"worker mesh dims {dims} hold {dims[0] * dims[1]} ranks, but "
                                  f"there are {len(worker_ranks)} worker ranks "
                                  f"[{t}, {self.world_size})")
            return
        try:
            mesh = Mesh(dims, start_rank=t)
            # Real plans use a handful of distinct placements: one Layout each, not one per
            # parameter (validation and hashing of 10^5 layouts is measurable).
            layouts = {p: Layout(mesh, p) for p in set(first.placements)}
            transfers = [ParamTransfer(s, layouts[p])
                         for s, p in zip(specs, first.placements, strict=True)]
        except PlanError as e:
            for r in worker_ranks:
                _add(failures, r, f"destination placements are invalid on the worker mesh: {e}")
            return
        try:
            plan = TransferPlan(transfers, trainer_ranks=t, world_size=self.world_size)
        except PlanError as e:
            for r in range(self.world_size):
                _add(failures, r, f"the plan is invalid: {e}")
            return
        try:
            chosen = choose_transport(plan, self._requested,
                                      {r: d.capabilities for r, d in sorted(dests.items())},
                                      dests[0].costs if 0 in dests else None)
        except (PlanError, ArithmeticError) as e:  # the same on every rank: same inputs
            for r in range(self.world_size):
                _add(failures, r, f"the transport could not be chosen: {e}")
            return
        if isinstance(chosen, dict):
            for r, msg in chosen.items():
                _add(failures, r, msg)
            return
        transport, reason, prediction = chosen
        self.plan = PreflightPlan(plan, complete_plan_digest(plan), transport, reason,
                                  None if prediction is None else prediction.seconds)

    def _check_data_plane(self, envs: Mapping[int, msgspec.Struct], failures: dict[int, str]
                          ) -> None:
        plan = self._agreed_plan()
        reports = {r: e for r, e in envs.items() if isinstance(e, DataPlaneReport)}
        for r, d in reports.items():
            _check_agreed(failures, r, d.transport, d.plan_digest, plan)
        ids = {r: d.identity for r, d in reports.items() if r not in failures}
        for what, values in (("libnccl version", {r: i.libnccl_version for r, i in ids.items()}),
                             ("max_cta", {r: i.max_cta for r, i in ids.items()})):
            _, odd = _outliers(values)
            for r, note in odd.items():
                _add(failures, r, f"{what} {values[r]!r} differs: {note}")
        envs_by_rank = {r: dict(i.env) for r, i in ids.items()}
        names = sorted({k for env in envs_by_rank.values() for k in env})
        per_rank: dict[int, list[str]] = {}
        for name in names:
            settings = {r: env.get(name, "<unset>") for r, env in envs_by_rank.items()}
            _, odd = _outliers(settings, str)
            for r, note in odd.items():
                per_rank.setdefault(r, []).append(f"{name}={settings[r]} ({note})")
        for r, parts in sorted(per_rank.items()):
            _add(failures, r, "NCCL variables differ: " + "; ".join(parts))
        if not failures:
            self.identities = dict(ids)

    def _check_runtime_ready(self, envs: Mapping[int, msgspec.Struct],
                             failures: dict[int, str]) -> None:
        plan = self._agreed_plan()
        for r, e in envs.items():
            if isinstance(e, RuntimeReady):
                _check_agreed(failures, r, e.transport, e.plan_digest, plan)

    # -- helpers ----------------------------------------------------------------------------

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise LocalProtocolError(f"handshake is in phase {self.phase.value!r}, not "
                                     f"{phase.value!r}")
        if self._awaiting is not None:
            raise LocalProtocolError(f"phase {phase.value!r} failed and waits for the records "
                                     f"of a plan disagreement")

    def _pending_records(self) -> _Disagreement:
        if self._awaiting is None:
            raise LocalProtocolError(f"handshake is in phase {self.phase.value!r} and waits "
                                     f"for no plan records")
        return self._awaiting

    def _where_specs_differ(self, plans: Mapping[int, SourcePlan], digests: Mapping[int, str],
                            ref: str | None, r: int) -> _Odd | None:
        """Where trainer ``r``'s specs first differ from a reference rank's (the majority's,
        or the lowest other rank on a tie), as far as the chunk digests tell: the chunk, and
        the run of parameters it covers with rank 0's names there when rank 0 shipped them."""
        q = _reference(digests, ref, r)
        if q is None:
            return None
        mine, theirs = plans[r], plans[q]
        at = first_difference(mine.chunks, theirs.chunks)
        if at is None:
            return None
        known = []
        if mine.n_params != theirs.n_params:
            known.append(f"rank {r} has {mine.n_params} parameters, rank {q} {theirs.n_params}")
        root = plans.get(0)
        names = ([p.name for p in root.params[at:at + DIFF_CHUNK]]
                 if root is not None and root.params is not None and q == 0 else [])
        span = f"parameters #{at}..#{at + DIFF_CHUNK - 1}"
        if names:
            span += f" (rank 0 has {_names(names)} there)"
        return _Odd(q, at // DIFF_CHUNK, "", known,
                    f"the first difference from rank {q} is within {span}")

    def _where_placements_differ(self, dests: Mapping[int, DestinationPlan],
                                 workers: Mapping[int, tuple[object, object]], ref: object,
                                 r: int) -> _Odd | None:
        """Where worker ``r``'s destination first differs from a reference worker's: its mesh
        dims (told at once, with every worker's), and the chunk of placements where they
        first differ (``chunk`` -1: none), with the names there and the first worker's
        placements when it is the reference."""
        q = _reference(workers, ref, r)
        if q is None:
            return None
        known = []
        if workers[r][0] != workers[q][0]:
            dims = {w: v[0] for w, v in workers.items()}
            known.append(_clause("worker mesh dims", dims, lambda d: str(tuple(d))))  # type: ignore[arg-type]
        at = first_difference(dests[r].placement_chunks, dests[q].placement_chunks)
        if at is None:
            return _Odd(q, -1, "", known, "")
        specs = self._specs or ()
        names = [s.name for s in specs[at:at + DIFF_CHUNK]]
        span = f"parameters #{at}..#{at + DIFF_CHUNK - 1}"
        if names:
            span += f" {_names(names)}"
        first = dests.get(self.trainer_ranks)
        if first is not None and first.placements is not None and q == self.trainer_ranks:
            shown = ", ".join(f"{n}: {show_placements(p)}" for n, p in zip(
                names, first.placements[at:at + DIFF_CHUNK], strict=False))
            span += f"; rank {q} asks for {{{shown}}}" if shown else ""
        return _Odd(q, at // DIFF_CHUNK, "", known,
                    f"the first difference from rank {q} is within {span}")

    def _first_difference_text(self, pending: _Disagreement,
                               shipped: Mapping[tuple[int, int], tuple[object, ...]], r: int,
                               odd: _Odd) -> str | None:
        """From the exchanged records: the first parameter where rank ``r`` differs from its
        reference, each field that differs there and who holds which value; None when the
        records of either side are missing (or equal despite their digests)."""
        k = odd.chunk
        records: dict[bytes, tuple[object, ...]] = {}  # chunk version -> its records
        for version, holders in pending.versions(k).items():
            for h in holders:
                if (h, k) in shipped:
                    records[version] = shipped[(h, k)]
                    break
        mine = records.get(pending.version(r, k))
        theirs = records.get(pending.version(odd.reference, k))
        if mine is None or theirs is None:
            return None
        j = next((j for j in range(max(len(mine), len(theirs)))
                  if j >= len(mine) or j >= len(theirs) or mine[j] != theirs[j]), None)
        if j is None:
            return None
        index = k * DIFF_CHUNK + j
        # every compared rank whose version of the chunk is known, with its record there
        at: dict[int, object] = {}
        for version, holders in pending.versions(k).items():
            if version in records:
                recs = records[version]
                for h in holders:
                    at[h] = recs[j] if j < len(recs) else _ABSENT
        a = mine[j] if j < len(mine) else _ABSENT
        b = theirs[j] if j < len(theirs) else _ABSENT
        fields = (_SPEC_FIELDS if pending.phase is Phase.SOURCE else _PLACEMENT_FIELDS)
        if a is _ABSENT or b is _ABSENT:  # one plan ends before the other
            _, get, show = fields[0]  # the name (source), the placements (destination)
            return f"the first difference is parameter #{index}: " + _clause(
                "", at, lambda v: "absent" if v is _ABSENT else show(get(v)))
        differing = [(label, get, show) for label, get, show in fields if get(a) != get(b)]
        if pending.phase is Phase.SOURCE:
            name = a.name if a.name == b.name else None  # type: ignore[attr-defined]
        else:
            specs = self._specs or ()
            name = specs[index].name if index < len(specs) else None
        clauses = [_clause(label, {h: get(v) for h, v in at.items() if v is not _ABSENT},
                           show) for label, get, show in differing]
        what = f"parameter #{index}" + (f" {name!r}" if name is not None else "")
        return f"the first difference is {what}, in its " + "; and its ".join(clauses)

    def _agreed_specs(self) -> tuple[ParamSpec, ...]:
        if self._specs is None:
            raise LocalProtocolError("the source plan has not been agreed yet")
        return self._specs

    def _agreed_plan(self) -> PreflightPlan:
        if self.plan is None:
            raise LocalProtocolError("the plan has not been agreed yet")
        return self.plan


def _check_agreed(failures: dict[int, str], r: int, transport: str, digest: str,
                  plan: PreflightPlan) -> None:
    if transport != plan.transport:
        _add(failures, r, f"prepared transport {transport!r}, but {plan.transport!r} was "
                          f"agreed")
    elif digest != plan.digest:
        _add(failures, r, f"prepared plan {_dig(digest)}, but plan {_dig(plan.digest)} was "
                          f"agreed")


class _Absent:
    """A record a rank does not have (its plan ends before it)."""

    def __repr__(self) -> str:
        return "absent"


_ABSENT: Final = _Absent()

_Field: TypeAlias = tuple[str, Callable[[object], object], Callable[[object], str]]


def _spec_field(attr: str, show: Callable[[object], str]) -> _Field:
    parts = attr.split(".")

    def get(spec: object) -> object:
        for part in parts:
            spec = getattr(spec, part)
        return spec

    return (attr.rsplit(".", 1)[-1], get, show)


def _show_mesh(mesh: object) -> str:
    assert isinstance(mesh, Mesh)
    return f"{mesh.dims} from rank {mesh.start_rank}"


def _show_placements(p: object) -> str:
    return show_placements(p)  # type: ignore[arg-type]


# What a source spec is compared by, in this order (the order messages name them in).
_SPEC_FIELDS: Final[tuple[_Field, ...]] = (
    _spec_field("name", repr), _spec_field("dtype", str), _spec_field("shape", str),
    _spec_field("layout.mesh", _show_mesh), _spec_field("layout.placements", _show_placements),
)
_PLACEMENT_FIELDS: Final[tuple[_Field, ...]] = (("placements", lambda p: p, _show_placements),)


def _reference(values: Mapping[int, object], ref: object, r: int) -> int | None:
    """The rank ``r`` is compared with: the lowest other holder of the reference value, or on
    a tie (``ref`` None) the lowest other rank."""
    return next((q for q in sorted(values) if q != r and (ref is None or values[q] == ref)),
                None)


def _clause(label: str, values: Mapping[int, object], show: Callable[[object], str]) -> str:
    """``label`` and each value with the ranks holding it, the most held first; says so when
    the most held value is tied (no side is taken as right)."""
    held: dict[object, list[int]] = {}
    for r in sorted(values):
        held.setdefault(values[r], []).append(r)
    ranked = sorted(held.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    text = (f"{label} " if label else "") + ", ".join(
        f"{show(v)} on rank(s) {_short(rs)}" for v, rs in ranked)
    if len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1]):
        text += " (no majority: neither is taken as right)"
    return text


def _compose(head: str, parts: Sequence[str]) -> str:
    shown = [p for p in parts if p]
    return f"{head} ({'; '.join(shown)})" if shown else head


def _placement(name: str, p: object) -> tuple[int, int] | None:
    if p is None:
        return None
    pair = tuple(p) if isinstance(p, tuple | list) else ()
    if len(pair) != 2 or not all(type(x) is int for x in pair):
        raise PlanError(f"parameter {name!r} (destination side): placements must be two "
                        f"ints (REPLICATE or a tensor dim), got {p!r}")
    return (pair[0], pair[1])


def _names(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', …' if len(names) > limit else ''}]"


def _dig(digest: str | None) -> str:
    if digest is None:
        return "None"
    return digest[:12] + "…" if len(digest) > 12 else digest


def _show_digest(value: object) -> str:
    return _dig(value) if isinstance(value, str) else repr(value)


def _show_destination(value: object) -> str:
    assert isinstance(value, tuple)
    dims, digest = value
    return f"(mesh dims {dims}, placements {_show_digest(digest)})"


# -- docs -------------------------------------------------------------------------------------


def mermaid() -> str:
    """A Mermaid ``stateDiagram-v2`` of ``TRANSITIONS`` (events to one target are merged)."""
    lines = ["stateDiagram-v2", f"    [*] --> {Phase.HELLO.value}"]
    for phase, row in TRANSITIONS.items():
        by_target: dict[Phase, list[str]] = {}
        for event, target in row.items():
            by_target.setdefault(target, []).append(event.value)
        for target, events in by_target.items():
            lines.append(f"    {phase.value} --> {target.value}: {' / '.join(events)}")
        if not row:
            lines.append(f"    {phase.value} --> [*]")
    return "\n".join(lines) + "\n"


def phases_doc() -> str:
    """The whole of ``docs/phases.md``, generated from ``TRANSITIONS`` and the phase notes."""
    rows = "\n".join(f"| `{p.value}` | {_PHASE_DOC[p]} |" for p in Phase)
    return (
        "# Preflight phases\n\n"
        "<!-- Generated by `python -m m2n_async._proto.handshake --doc > docs/phases.md`\n"
        "     from TRANSITIONS in m2n_async/_proto/handshake.py; a test fails when stale. -->\n\n"
        "Every rank runs these phases before any communicator exists. Each gathering phase is "
        "one\nall-gather of an envelope that every rank sends even when its local step failed, "
        "so\nevery rank raises the same `PreflightError(phase, {rank: message})`; a local step "
        "that\nhas not finished a report window before the phase deadline is its rank's "
        "failure,\nsent the same way. A phase that passes its deadline raises `TimeoutError` "
        "naming the\nranks that did not arrive; a rank whose store session ends makes the "
        "others raise\n`PeerLostError` naming it at once.\n\n"
        f"```mermaid\n{mermaid()}```\n\n"
        "| phase | agreement checked |\n|---|---|\n"
        f"{rows}\n"
    )


if __name__ == "__main__":  # pragma: no cover - exercised through the docs test
    import sys

    arg = sys.argv[1] if len(sys.argv) > 1 else "--doc"
    if arg not in ("--doc", "--mermaid"):
        sys.exit("usage: python -m m2n_async._proto.handshake [--doc | --mermaid]")
    sys.stdout.write(phases_doc() if arg == "--doc" else mermaid())
