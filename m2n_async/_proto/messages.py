"""Wire types: every envelope the control plane carries, as msgspec Structs.

Theory of operation: one tagged union (``Envelope``) and one reusable msgpack encoder and
decoder. Structs are frozen and forbid unknown fields, so a peer speaking another protocol
version fails loudly at decode time instead of being misread. ``PROTO_VERSION`` travels in the
first envelope (``Hello``) and must be equal on every rank.

Sections: plan records (core), handshake envelopes (handshake), round messages (engine).
"""

from __future__ import annotations

from typing import Final, TypeAlias, TypeVar

import msgspec

from m2n_async._proto.errors import PlanError, RemoteProtocolError
from m2n_async._proto.params import ParamSpec, ParamTransfer

PROTO_VERSION: Final[int] = 3

# --- plan records (core) ---

PLAN_SCHEMA_VERSION: Final[int] = 1
"""Version of the plan record layout; part of every plan digest (bump on any field change)."""


class SourcePlanRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """The ordered source specs as trainer rank 0 ships them to every rank."""

    trainer_ranks: int
    params: tuple[ParamSpec, ...]


class PlanRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """A complete plan (source specs plus destination layouts), e.g. for logs or `m2n-async plan`.

    ``TransferPlan.record()`` / ``TransferPlan.from_record()`` convert.
    """

    trainer_ranks: int
    world_size: int
    params: tuple[ParamTransfer, ...]


# --- handshake envelopes ---
# One envelope per phase (see _proto/handshake.py), all-gathered by every rank. Every field is
# required (no defaults) so that a missing field is a decode error, never a silent default.
# ``proto_version``, ``generation`` and ``rank`` travel in each one: each envelope is
# validated on its own, and a stray envelope of another generation or slot is named.


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Phase ``hello``: the topology this rank was started with."""

    proto_version: int
    generation: int
    rank: int
    role: str  # "trainer" | "worker"
    world_size: int
    trainer_ranks: int
    transport: str  # requested: "auto" | "m2n" | "nccl" | "gloo"


class SourcePlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Phase ``source``: trainers' source-plan digests; trainer rank 0 also ships the specs."""

    proto_version: int
    generation: int
    rank: int
    digest: str | None  # trainers: source_plan_digest; workers: None
    params: tuple[ParamSpec, ...] | None  # trainer rank 0 only
    #: trainers: 4 bytes of digest per run of ``DIFF_CHUNK`` specs and the spec count, so
    #: that a rank whose plan differs is told where (``handshake.first_difference``)
    chunks: bytes | None
    n_params: int | None


class LaneCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One data plane's cost terms (``_proto.cost``): a round takes about ``calls x
    call_seconds + params x param_seconds + busiest rank's bytes / bytes_per_second``."""

    lane: str
    call_seconds: float        # one native call: an M2N reshard; one bucket's exchange
    param_seconds: float       # host work per parameter per round (lookups, pack bookkeeping)
    bytes_per_second: float    # per-rank link rate
    bucket_bytes: int          # the lane's bucket size (its calls depend on it)


class CostInputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``transport="auto"`` predicts each lane's round from; equal on every rank."""

    lanes: tuple[LaneCost, ...]
    coalesce_below: int        # m2n coalescing threshold; 0: off


class DestinationPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Phase ``destination``: capabilities of every rank; workers' mesh and placements.

    ``placements`` is aligned with the source plan's parameter order and shipped by the first
    worker only; the others send its digest, so the gather stays O(params), not
    O(workers x params).
    """

    proto_version: int
    generation: int
    rank: int
    capabilities: tuple[str, ...]  # transports this rank can run, best first
    mesh_dims: tuple[int, int] | None  # workers only
    placements_digest: str | None  # workers only
    placements: tuple[tuple[int, int] | None, ...] | None  # the first worker only
    placement_chunks: bytes | None  # workers: as ``SourcePlan.chunks``, of the placements
    costs: CostInputs | None  # what auto's choice is predicted from (None: preference)


class DataPlaneIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Local facts of the chosen data plane that must be equal on every rank.

    ``env`` names each variable once: the ``data_plane`` phase compares it as a mapping,
    where a second value of a name would replace the first and could hide a mismatch (or
    name the wrong value). A name given twice is refused with ``PlanError`` where the
    identity is built, and off the wire as an invalid envelope naming its sender.
    """

    libnccl_version: str | None
    max_cta: int | None
    env: tuple[tuple[str, str], ...]  # sorted (name, value) of the variables that must match

    def __post_init__(self) -> None:
        # Runs on construction, on msgspec.structs.replace (the handshake's normalization to
        # str) and on decode; a few dozen entries, so a set is cheap enough.
        env = self.env
        if len({entry[0] for entry in env}) == len(env):
            return
        values: dict[str, list[str]] = {}
        for name, value in env:
            values.setdefault(name, []).append(value)
        twice = "; ".join(f"{name}: {', '.join(repr(v) for v in vs)}"
                          for name, vs in sorted(values.items()) if len(vs) > 1)
        raise PlanError(f"data-plane identity gives a variable more than once ({twice}); "
                        "each name must appear once, with the one value every rank compares")


class DataPlaneReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Phase ``data_plane``: the transport and plan this rank will run, and its identity."""

    proto_version: int
    generation: int
    rank: int
    transport: str
    plan_digest: str
    identity: DataPlaneIdentity


class RuntimeReady(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Phase ``runtime_ready``: local resources are prepared for this transport and plan."""

    proto_version: int
    generation: int
    rank: int
    transport: str
    plan_digest: str


class PhaseFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Any phase: this rank's local step raised; ``error`` says what, for every rank to report."""

    proto_version: int
    generation: int
    rank: int
    phase: str
    error: str


class DiffRecords(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """After ``source`` or ``destination`` found plans that differ: this rank's records of
    the chunks (``DIFF_CHUNK`` records each) that every rank computed it must ship, so that
    all name the first parameter and field that differ; ranks asked for none send empty."""

    proto_version: int
    generation: int
    rank: int
    phase: str
    chunks: tuple[int, ...]  # chunk indices, ascending
    specs: tuple[tuple[ParamSpec, ...], ...]  # source: this trainer's specs of each chunk
    placements: tuple[tuple[tuple[int, int] | None, ...], ...]  # destination: a worker's


class CommunicatorId(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """After every phase passed: rank 0's NCCL unique id, broadcast with its SHA-256."""

    proto_version: int
    generation: int
    digest: str
    unique_id: bytes


# --- round messages (engine) ---
# Written under ``{job}/{generation}/round/{round}/``: ``start`` (trainer rank 0),
# ``done/{rank}`` (every rank) and ``abort`` (the first failing rank wins a compare-and-set, so
# every rank reads the same first failure and raises the same error).
# RoundDone and Abort gained fields (status, suspects, reporter; cause, reporter) without a
# PROTO_VERSION bump, which would change every plan digest: a peer of the older layout fails
# to decode them (required fields), and the round names it as a protocol failure.


class RoundStart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """Trainer rank 0 opens round ``round``: the version it will commit and its deadline.

    ``closing`` marks the end of the job's rounds (trainer rank 0 closed its engine): workers
    waiting for a round stop instead of waiting for ever. ``error``, on a closing start: rank
    0 closed on an error (an exception left its ``async with``), whose text this is — the
    ranks waiting raise it instead of ending as at a clean end of the job.
    """

    proto_version: int
    generation: int
    round: int
    version: int
    round_timeout: float  # seconds; every rank bounds its part of the round by it
    closing: bool
    error: str | None = None


class RoundDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """One rank's outcome of a round; gathered by every rank before the version commits.

    Written once per rank and round, by compare-and-set (``_proto.round``): by the rank itself,
    or — ``status == "late"`` — by a peer (``reporter``) once the round deadline passed without
    it, so that a rank resuming after a freeze cannot turn a failed round into a committed one.
    """

    proto_version: int
    generation: int
    round: int
    rank: int
    ok: bool
    error: str | None  # why this rank failed (None when ok)
    nbytes: int  # bytes this rank sent or received
    seconds: float
    status: str  # _proto.round.Status value: ok | failed | aborted | deadline | late
    suspects: tuple[int, ...]  # the peers it was still waiting on (deadline, aborted)
    reporter: int  # the rank that wrote this record (``rank`` unless status is "late")


class Abort(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """The first failure of a round: watchdogs on every rank abort their data plane on it.

    ``rank`` is the rank that caused it (the failing, cancelled, lost, departed or late one),
    ``cause`` why (a ``_proto.round.Cause`` value), ``reporter`` the rank that wrote it.
    """

    proto_version: int
    generation: int
    round: int
    rank: int
    cause: str
    reason: str
    reporter: int


# --- the union, encoder, decoder ---
# Helpers adding envelopes: define the Struct in your section above (frozen=True,
# forbid_unknown_fields=True, tag=True) and add it to this one line.
Envelope: TypeAlias = (SourcePlanRecord | PlanRecord
                       | Hello | SourcePlan | DestinationPlan | DataPlaneReport | RuntimeReady
                       | PhaseFailure | DiffRecords | CommunicatorId  # handshake
                       | RoundStart | RoundDone | Abort)  # rounds

_T = TypeVar("_T")
_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Envelope)
_TYPED_DECODERS: dict[object, msgspec.msgpack.Decoder[object]] = {}


def encode(msg: Envelope) -> bytes:
    """msgpack bytes of one envelope (its class name travels as the ``type`` tag)."""
    return _ENCODER.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Envelope:
    """Decode one envelope of any kind in the union.

    Raises ``RemoteProtocolError`` naming the missing, unexpected or mistyped field (msgspec's
    path, e.g. ``$.params[3].shape``) or the malformed input.
    """
    try:
        return _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _translate(e, "envelope") from e


def decode_as(data: bytes | bytearray | memoryview, type_: type[_T]) -> _T:
    """Decode bytes that must hold exactly ``type_`` (any Struct, tagged or not).

    A different envelope kind is refused like any other mismatch: ``RemoteProtocolError``.
    """
    dec = _TYPED_DECODERS.get(type_)
    if dec is None:
        dec = _TYPED_DECODERS[type_] = msgspec.msgpack.Decoder(type_)
    try:
        result = dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _translate(e, type_.__name__) from e
    assert isinstance(result, type_)
    return result


def _translate(e: Exception, what: str) -> RemoteProtocolError:
    # msgspec's message already names the field and its path ("Object missing required field
    # `x` - at `$.params[0]`"); keep it verbatim and say what we were decoding.
    kind = "invalid" if isinstance(e, msgspec.ValidationError) else "malformed"
    return RemoteProtocolError(f"{kind} {what} from peer (protocol version {PROTO_VERSION}): {e}")
