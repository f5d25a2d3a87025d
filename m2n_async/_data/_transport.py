"""The ``Transport`` ABC: what a data plane (gloo, nccl, m2n) must provide to the engine.

Theory of operation. A transport moves the bytes of ONE agreed ``TransferPlan`` between the
ranks of one generation. It never decides anything that must agree between ranks — the plan,
the bucket boundaries and the transport name come from the handshake — so every rank issues
the same operations in the same order by construction (a mismatch would hang NCCL).

Lifecycle (who calls what, and when)::

    class-level, before the plan is agreed (handshake phases destination / data_plane):
        Transport.unavailable_reason(settings)  -> None or why not usable in this process
        Transport.identity(settings)             -> values that must be equal on every rank
    (whether a lane can carry the plan is a fact of the plan: ``_proto.plan.carry_problem``,
    which the handshake applies to every lane)
    after the destination phase (plan agreed):
        t = create_transport(name, TransportContext(...))    # cheap: no I/O, no resources
    in the runtime_ready phase (local only, no peer communication):
        await t.prepare()        # select device, create M2N handle, size persistent staging
    after every phase passed (collective over all ranks):
        await t.connect(rendezvous)   # create the communicator (unique id via the store)
    each round (engine pipeline, DESIGN §7):
        t.begin_round(round, deadline)
        for each bucket, up to max_inflight at once:
            staging = await t.stage(bucket, sources=..)   # trainer: pack
            staging = await t.stage(bucket, sinks=..)     # worker: allocate (or zero-copy)
            completion = t.transfer(staging)          # submit sends/recvs on native thread
            await completion.wait()                   # event loop, never blocks it
            await t.unpack(staging, sinks)            # worker: into targets / load callbacks
            t.release(staging)
        t.end_round()
    any time, from any thread:
        t.abort(reason)          # fail-stop: unblock everything, never reused afterwards
    finally:
        await t.close()

Buffers: every buffer handed to ``transfer`` is referenced by its ``Staging`` (and by the
completion) until ``completion.wait()`` has returned — on CUDA that is what keeps the caching
allocator from recycling memory a stream still reads. The pipeline holds at most
``max_inflight`` stagings, so extra memory is bounded by ``max_inflight * bucket_bytes`` plus
``static_bytes`` (the transport's own persistent staging); ``Staging.nbytes`` is what the
pipeline counts and reports as peak extra memory.

Threads and streams: ``stage`` and ``unpack`` are coroutines so a transport chooses where the
work runs — the CPU transport packs on a helper thread (torch copies release the GIL), a CUDA
transport enqueues on its pack/unpack streams and may return as soon as the work is *ordered*
(an event recorded that the transfer stream waits on). ``transfer`` returns at once; the
native calls run on the engine's ``NativeThread`` in plan order. ``Completion.wait`` is the one
place the loop learns that bytes moved: a ``NativeCall``, a CUDA-event watcher, or polling.

Errors: transports raise ``TransferError`` naming the transport, rank, round, bucket and peer
when they can; native exceptions (Gloo ``RuntimeError``, ``NcclReshardError``...) are
translated here, never leaked. Timeouts stay the builtin ``TimeoutError``. Two attributes
tell the round driver whom to blame: ``err.peer`` (an int) when a peer closed its
connection (a symptom of that peer), ``err.own_step = True`` when this rank's own step failed
with its bytes in hand (a load callback raised), so no peer's cause is waited for.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias

import anyio

from m2n_async._data._native import NativeCall, NativeThread
from m2n_async._proto.errors import LocalProtocolError, PeerLostError, PlanError, TransferError
from m2n_async._proto.stacking import COALESCE_BELOW_BYTES

if TYPE_CHECKING:
    import torch

    from m2n_async._proto.plan import Bucket, TransferPlan
    from m2n_async._store import Store

__all__ = [
    "TRANSPORTS",
    "CheckedSources",
    "CheckedTargets",
    "Completion",
    "LoadCallback",
    "NativeCompletion",
    "Rendezvous",
    "Role",
    "Sink",
    "SinkLike",
    "SinkMap",
    "Staging",
    "Transport",
    "TransportContext",
    "TransportSettings",
    "create_transport",
    "sink_map",
    "transport_class",
]

Role = Literal["trainer", "worker"]

#: A worker target declared as a callback: called as ``fn(name, tensor)`` with the rank's
#: destination shard of ``name``. The tensor may be a view into transport staging and is
#: valid only during the call (copy it, as ``load_weights`` implementations do). Callbacks
#: run on the transport's unpack thread (CPU) or after the unpack stream synchronized (CUDA),
#: one at a time, in plan order.
LoadCallback: TypeAlias = Callable[[str, "torch.Tensor"], None]


@dataclass(frozen=True, slots=True, eq=False)
class Sink:
    """Where a worker's destination shard of one parameter goes, decided once per target:
    ``target`` is a tensor written in place (``in_place``) or a ``LoadCallback`` fed from
    staging. The engine builds one per name at connect (its ``SinkMap``); the lanes read
    ``in_place`` instead of asking the target's type again for every bucket."""

    target: torch.Tensor | LoadCallback
    in_place: bool
    #: The target's placements on the worker mesh (what the destination phase sends).
    placements: tuple[int, int] | None = None
    #: What the engine checks against the plan (``validate_local_buffer``): the tensor
    #: itself, or the declaration a callback came with (a ``LoadTarget``: shape, dtype,
    #: device). None: the target. Whatever the caller passed: validation says what is wrong.
    declared: Any = None

    @classmethod
    def of(cls, target: torch.Tensor | LoadCallback, *,
           placements: tuple[int, int] | None = None, declared: Any = None) -> Sink:
        """The record of ``target``: written in place when it is a tensor."""
        import torch  # here, not at import: ``import m2n_async`` stays torch-free

        return cls(target, isinstance(target, torch.Tensor), placements,
                   target if declared is None else declared)

    @property
    def tensor(self) -> torch.Tensor:
        """``target`` as the tensor it is when ``in_place`` (check that first)."""
        return self.target  # type: ignore[return-value]

    @property
    def load(self) -> LoadCallback:
        """``target`` as the load callback it is when not ``in_place`` (check that first)."""
        return self.target  # type: ignore[return-value]


class SinkMap(dict[str, Sink]):
    """name -> ``Sink``, built once (the engine's, at connect). A transport takes it as it
    is; any other mapping handed to ``stage``/``unpack`` goes through ``sink_map`` first."""


@dataclass(frozen=True, slots=True, eq=False)
class CheckedSources:
    """One round's sources as the trainer's engine checked them before the round: each
    plan parameter's local shard and its dtype, in plan order. A lane may take a bucket's
    shards from here by plan index instead of looking each one up by name and reading its
    dtype again (two passes over every tensor a round: ~0.15 µs a shard on the CPU), for
    the ``sources`` mapping it was made from only (``for_sources``). The engine hands it to
    the transport for one round (``Transport.use_checked``) and takes it back after."""

    #: the mapping ``stage`` gets as ``sources`` (by identity)
    mapping: Mapping[str, Any]
    #: plan index -> the shard ``mapping`` holds under that parameter's name
    tensors: Sequence[torch.Tensor]
    #: plan index -> that shard's dtype (the wire dtype, or a float one cast while packing)
    dtypes: Sequence[torch.dtype]


@dataclass(frozen=True, slots=True, eq=False)
class CheckedTargets:
    """One bucket's in-place targets as the worker's engine checked them in this round: a
    lane that reads the targets' addresses every round (to see a target given new storage)
    may compare these instead of reading them again (a pass over every target: ~0.1 µs a
    target on the CPU). Handed per bucket before its ``stage`` (``use_checked_targets``),
    taken once (``checked_targets``)."""

    #: the sinks mapping the check read (by identity: what ``stage`` gets as ``sinks``)
    sinks: Mapping[str, Any]
    #: plan indices of the bucket's parameters whose targets are tensors written in place,
    #: in plan order (one object per bucket across rounds: a lane may cache what it decided
    #: of them by identity)
    params: tuple[int, ...]
    #: their ``data_ptr()``, in the same order, read by the check in this round
    addresses: list[int]


#: A worker target as ``stage``/``unpack`` accept it: a ``Sink``, or (tests and benches that
#: drive a transport directly) the bare tensor or load callback.
SinkLike: TypeAlias = "Sink | torch.Tensor | LoadCallback"


def sink_map(sinks: Mapping[str, SinkLike]) -> SinkMap:
    """``sinks`` as records: a ``SinkMap`` as it is, any other mapping converted (a value of
    None counts as no sink, as a missing name does)."""
    if isinstance(sinks, SinkMap):
        return sinks
    import torch  # once per mapping, not per target

    return SinkMap({name: s if isinstance(s, Sink) else
                    Sink(s, isinstance(s, torch.Tensor), None, s)
                    for name, s in sinks.items() if s is not None})


#: The longest native wait ``Transport.remaining`` gives (~31 years): well within what a
#: thread's wait and Gloo's nanosecond clock take, beyond any round deadline meant as one.
_MAX_WAIT_S = 1e9

#: lane name (``_proto.lanes.LANES``) -> import path of its class. Imported lazily: importing
#: ``nccl.m2n`` without a GPU runtime fails, and a CPU job must not pay for (or trip over) it.
TRANSPORTS: dict[str, str] = {
    "m2n": "m2n_async._data.m2n:M2NTransport",
    "nccl": "m2n_async._data.nccl:NcclTransport",
    "gloo": "m2n_async._data.gloo:GlooTransport",
}


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """The part of ``EngineConfig`` the data plane reads. Identical on every rank where it
    matters (``max_cta`` is compared in the data_plane phase). Bucket boundaries are not
    here but in ``TransportContext.buckets``, and the bound on creating the communicator is
    ``Rendezvous.timeout``: each reaches a lane one way only."""

    #: Buckets between ``stage`` and ``release`` at once: the lanes keep this many staging
    #: arenas, and the engine's pipeline admits this many (it reads it from here).
    max_inflight: int
    max_cta: int | None = None
    #: "cpu", "cuda", "cuda:N", or None (gloo: cpu; GPU transports: current CUDA device).
    device: str | None = None
    #: Seconds ``close`` may wait, in all, for queued GPU work and the communicator's abort
    #: (the engine's ``abort_grace``): past it the abort is left to finish on its own thread.
    close_timeout: float = 10.0
    #: Address the CPU data plane binds and advertises (gloo). None: 127.0.0.1 when the
    #: store is on loopback, else torch's default (hostname / ``GLOO_SOCKET_IFNAME``).
    host: str | None = None
    #: ``m2n``: stack same-geometry parameters of a bucket into one reshard
    #: (``_proto.stacking``); changes what is on the wire, so the handshake compares it.
    coalesce: bool = True
    #: ``m2n``: a parameter any rank moves this many bytes of (or more) stays a single,
    #: zero-copy reshard; only smaller ones are stacked (``_proto.stacking``).
    coalesce_below: int = COALESCE_BELOW_BYTES

    def __post_init__(self) -> None:
        if self.coalesce_below < 0:
            raise PlanError(f"coalesce_below must be >= 0, got {self.coalesce_below}")
        if self.max_inflight < 1:
            raise PlanError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_cta is not None and self.max_cta < 1:
            raise PlanError(f"max_cta must be >= 1 or None, got {self.max_cta}")


@dataclass(frozen=True)
class TransportContext:
    """Everything a transport is constructed from, fixed once the plan is agreed."""

    plan: TransferPlan
    rank: int
    generation: int
    settings: TransportSettings
    #: The engine's native-call thread: every native call of this transport runs on it.
    native: NativeThread
    #: The agreed bucket boundaries (the plan cut at the agreed ``bucket_bytes``), identical
    #: on every rank; passed in so that the transport never recomputes them differently.
    #: The engine's pipeline walks these very buckets.
    buckets: tuple[Bucket, ...]
    job: str = "m2n"
    #: Worker only: indices of the parameters whose target is a tensor (a message for them
    #: can land in place: their ``Sink.in_place``); the others are load callbacks, fed from
    #: staging. None: unknown, so a transport must size staging as if nothing lands in place.
    in_place: frozenset[int] | None = None

    @property
    def trainer_ranks(self) -> int:
        return int(self.plan.trainer_ranks)

    @property
    def world_size(self) -> int:
        return int(self.plan.world_size)

    @property
    def role(self) -> Role:
        return "trainer" if self.rank < self.trainer_ranks else "worker"

    def where(self, *, round: int | None = None, bucket: int | None = None,
              peer: int | None = None, param: str | None = None) -> str:
        """A location string for error messages: generation, rank, round, bucket, peer."""
        parts = [f"generation {self.generation}", f"rank {self.rank} ({self.role})"]
        if round is not None:
            parts.append(f"round {round}")
        if bucket is not None:
            parts.append(f"bucket {bucket}")
        if peer is not None:
            parts.append(f"peer rank {peer}")
        if param is not None:
            parts.append(f"param {param!r}")
        return ", ".join(parts)


@dataclass(eq=False)
class Staging:
    """One bucket's buffers on this rank, from ``stage`` until ``release``.

    Transports subclass it to hold their buffers. The pipeline only reads ``bucket``,
    ``nbytes`` (extra memory held: counted for the ``max_inflight * bucket_bytes`` bound and
    the reported peak) and ``nbytes_moved`` (bytes this rank sends or receives for the
    bucket: the round's byte count, checked against the plan so a silent zero-byte "success"
    cannot pass).
    """

    bucket: Bucket
    nbytes: int = 0
    nbytes_moved: int = 0
    #: Bytes (in the wire dtype) this rank produced by casting a source of another dtype
    #: while packing the bucket (trainer; 0 when every source already had the wire dtype).
    cast_bytes: int = 0
    #: Device-measured seconds per stage ("pack", "transfer", "unpack") when the transport
    #: can measure them (CUDA events); the pipeline otherwise uses its own wall times.
    seconds: dict[str, float] = field(default_factory=dict)


class Completion(ABC):
    """The outcome of one ``transfer``: awaitable from the loop, never blocking it."""

    @abstractmethod
    def done(self) -> bool:
        """True once the bucket's transfer finished (successfully or not)."""

    @abstractmethod
    async def wait(self) -> None:
        """Return when this rank's part of the bucket has moved: sent buffers may be reused
        (trainer) and received bytes are in staging (worker). Raise ``TransferError`` (or
        ``TimeoutError`` for the round deadline) otherwise.

        Cancellation: stops waiting only; the transfer keeps its buffers until the transport
        is aborted or the transfer ends. The engine aborts the transport when it cancels a
        round, so the staging is then released by ``close``.
        """


class NativeCompletion(Completion):
    """A ``Completion`` backed by a ``NativeCall`` (CPU transports, and GPU transports whose
    native call itself waits). Holds ``keep`` (buffers) until the call completed."""

    def __init__(self, call: NativeCall[object], keep: object = None,
                 translate: Callable[[BaseException], BaseException] | None = None) -> None:
        self._call = call
        self._keep = keep
        self._translate = translate

    def done(self) -> bool:
        return self._call.done()

    async def wait(self) -> None:
        try:
            await self._call.wait()
        except (TransferError, TimeoutError, PeerLostError):
            raise
        except Exception as exc:
            if self._translate is None:
                raise
            raise self._translate(exc) from exc
        finally:
            if self._call.done():
                self._keep = None  # buffers may be freed now, not one bucket later


class Rendezvous:
    """What ``Transport.connect`` may use to agree on communicator bootstrap data.

    Keys live under ``prefix`` (``{job}/{generation}/data/{transport}/``) in the engine's
    store, so a stale generation can never read them. Each call is bounded by ``timeout``
    seconds (``TimeoutError`` naming the step) and fails at once with ``PeerLostError`` when a
    ``watch``ed liveness key of a peer vanishes.
    """

    def __init__(self, store: Store, prefix: str, *, rank: int, world_size: int,
                 timeout: float, watch: Sequence[str] = ()) -> None:
        self.store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.watch = tuple(watch)

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    @contextmanager
    def _bounded(self, name: str, what: str) -> Iterator[None]:
        """``fail_after(timeout)``, its ``TimeoutError`` saying which step waited for what."""
        try:
            with anyio.fail_after(self.timeout):
                yield
        except TimeoutError:
            raise TimeoutError(f"rendezvous {name!r} under {self.prefix!r}: rank {self.rank} "
                               f"of {self.world_size} waited {self.timeout:g} s for {what} "
                               "and it did not come") from None

    async def broadcast(self, payload: bytes | None, *, name: str, root: int = 0) -> bytes:
        """``root`` passes the payload, every other rank ``None``; all get root's bytes.

        Cancellation: nothing to undo (at most root's key was written; the generation's
        prefix is deleted with the generation).
        """
        key = self.key(f"{name}/root")
        with self._bounded(name, f"rank {root}'s {name!r}"):
            if self.rank == root:
                if payload is None:
                    raise LocalProtocolError(f"rendezvous {name!r}: root {root} has no payload")
                await self.store.set(key, payload)
                return payload
            got = await self.store.get(key, wait=True, watch=self.watch)
        if got is None:  # pragma: no cover - get(wait=True) returns bytes by contract
            raise PeerLostError(f"rendezvous {name!r}: root rank {root} published nothing",
                                ranks=(root,))
        return got

    async def all_gather(self, payload: bytes, *, name: str) -> list[bytes]:
        """Every rank contributes ``payload``; returns all of them indexed by rank.

        Cancellation: as ``broadcast``.
        """
        prefix = self.key(f"{name}/")
        with self._bounded(name, f"every rank's {name!r}"):
            await self.store.set(f"{prefix}{self.rank}", payload)
            got = await self.store.gather(prefix, self.world_size, watch=self.watch)
        out: list[bytes | None] = [None] * self.world_size
        for key, value in got.items():
            out[int(key.rsplit("/", 1)[-1])] = value
        missing = [r for r, v in enumerate(out) if v is None]
        if missing:
            raise PeerLostError(f"rendezvous {name!r}: no contribution from ranks {missing}",
                                ranks=tuple(missing))
        return [v for v in out if v is not None]


class Transport(ABC):
    """Base of the data planes (module docstring: lifecycle, buffers, threads, errors)."""

    #: The name agreed in the handshake: one of ``_proto.lanes.LANES``.
    name: ClassVar[str]

    @property
    def detail(self) -> str:
        """How this transport runs once connected, for reports (empty: nothing to add). The
        engine appends it to ``SyncResult.reason``; ``m2n`` says whether it groups."""
        return ""

    # ---- class level: usable before the plan is agreed -------------------------------

    @classmethod
    def unavailable_reason(cls, settings: TransportSettings) -> str | None:
        """None when this process can run the transport, else an actionable reason (what to
        install, which version was found). Must not create any resource."""
        return None

    @classmethod
    def identity(cls, settings: TransportSettings) -> dict[str, str]:
        """Values that must be identical on every rank (data_plane phase): libnccl version,
        ``max_cta``, every non-diagnostic ``NCCL_RESHARD_*`` variable, ... The handshake
        names the keys that differ."""
        return {}

    # ---- instance ---------------------------------------------------------------------

    def __init__(self, ctx: TransportContext) -> None:
        """Cheap and local: no I/O, no device memory, no communicator."""
        self.ctx = ctx
        self._abort_reason: str | None = None
        self._round: int | None = None
        self._deadline: float | None = None
        #: (mapping as passed, its records): one ``sink_map`` per mapping object and round.
        #: One attribute, so that a reader on another thread never pairs a mapping with the
        #: records of another.
        self._sink_cache: tuple[Mapping[str, SinkLike], SinkMap] | None = None
        #: the round's checked sources (trainer; ``use_checked``), or None
        self._checked: CheckedSources | None = None
        #: bucket index -> its targets as checked this round (worker; ``use_checked_targets``)
        self._checked_targets: dict[int, CheckedTargets] = {}

    def use_checked(self, checked: CheckedSources | None) -> None:
        """Trainer: the round's sources as the engine checked them (``CheckedSources``), or
        None to drop them (the engine does after the round's pipeline: the shards are not
        kept alive past it). A lane that has no use for them ignores them."""
        self._checked = checked

    def use_checked_targets(self, bucket: int, checked: CheckedTargets) -> None:
        """Worker, before ``stage`` of bucket ``bucket`` (the event loop's thread): its
        in-place targets as the engine checked them in this round (``CheckedTargets``)."""
        self._checked_targets[bucket] = checked

    def checked_targets(self, bucket: int) -> CheckedTargets | None:
        """What ``use_checked_targets`` handed for bucket ``bucket`` in this round, once;
        None when nothing was (read the addresses then)."""
        return self._checked_targets.pop(bucket, None)

    def for_sources(self, sources: Mapping[str, Any]) -> CheckedSources | None:
        """The checked sources of this round when they were made from ``sources``, else
        None (read by name then). Any thread."""
        checked = self._checked
        return checked if checked is not None and checked.mapping is sources else None

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    @property
    def static_bytes(self) -> int:
        """Persistent extra memory the transport holds outside per-bucket staging."""
        return 0

    @property
    def round(self) -> int | None:
        return self._round

    def remaining(self) -> float:
        """Seconds left until the round deadline (``time.monotonic`` clock; native threads
        cannot read the event loop's clock), at most ``_MAX_WAIT_S``. Raises
        ``TimeoutError`` when passed."""
        if self._deadline is None:
            return float("inf")
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.name}: round deadline passed at "
                               f"{self.ctx.where(round=self._round)}")
        # A deadline centuries off (round_timeout=1e12) must still let rounds run: a thread's
        # wait refuses more than ~292 years (OverflowError), and Gloo adds its wait to a
        # nanosecond clock that overflows int64 for about as much (it then times out at once).
        return min(left, _MAX_WAIT_S)

    def waiting_on(self) -> list[int]:
        """Peer ranks this rank is known to wait on in this round (an operation that failed
        or is being waited on, or one still pending where the transport can tell), for a
        deadline's verdict and message; empty when the transport cannot tell. Any thread."""
        return []

    def check_usable(self) -> None:
        """Raise ``TransferError`` if aborted (fail-stop: an aborted transport is never reused)."""
        if self._abort_reason is not None:
            raise TransferError(
                f"{self.name} transport aborted ({self._abort_reason}) at "
                f"{self.ctx.where(round=self._round)}", rank=self.ctx.rank, round=self._round)

    async def prepare(self) -> None:  # noqa: B027 - optional hook
        """runtime_ready phase: prepare local resources (device, handles, persistent staging).
        Local only: no peer communication. Errors are reported by the handshake on every rank.

        Cancellation: whatever was created is released by ``close``.
        """

    @abstractmethod
    async def connect(self, rendezvous: Rendezvous) -> None:
        """Create the communicator; collective over all ranks of the generation, bounded by
        ``rendezvous.timeout``. Called once, after every handshake phase passed.

        Cancellation: the partly created communicator is aborted by ``close``.
        """

    def begin_round(self, round: int, deadline: float) -> None:
        """A round starts. ``deadline`` is absolute on the ``time.monotonic`` clock; native
        waits take it as their timeout so a dead or stuck peer cannot hang this rank."""
        self.check_usable()
        self._round, self._deadline = round, deadline
        self._checked_targets.clear()  # nothing handed for an earlier round serves this one

    def end_round(self) -> None:
        """The round's buckets are all released (successfully or not)."""
        self._deadline = None
        self._sink_cache = None  # the caller's targets: not kept alive past the round
        self._checked_targets.clear()  # a verdict serves its own round only

    def sink_records(self, sinks: Mapping[str, SinkLike]) -> SinkMap:
        """``sinks`` as ``Sink`` records: the engine's ``SinkMap`` as it is; any other
        mapping (name -> tensor or load callback) converted once per mapping object and
        round, cached by identity until ``end_round``. Any thread."""
        if isinstance(sinks, SinkMap):
            return sinks
        cached = self._sink_cache
        if cached is not None and cached[0] is sinks:
            return cached[1]
        records = sink_map(sinks)
        self._sink_cache = (sinks, records)
        return records

    @abstractmethod
    async def stage(self, bucket: Bucket, *,
                    sources: Mapping[str, torch.Tensor] | None = None,
                    sinks: Mapping[str, SinkLike] | None = None) -> Staging:
        """Trainer: pack this rank's outgoing pieces of ``bucket`` from ``sources`` (name ->
        local shard, validated by the engine, covering at least the bucket's params).
        Worker: allocate the receive staging; ``sinks`` (name -> ``Sink``, or a bare target
        tensor or load callback: ``sink_records``; the same mapping ``unpack`` gets) lets a
        transport receive straight into a target tensor where the bytes arrive contiguous
        (zero-copy).

        Returns once the staging is ordered before any later ``transfer`` of it (a CUDA
        transport may return after enqueueing and recording an event).

        Cancellation: the returned staging is lost with the round; the engine aborts.
        """

    @abstractmethod
    def transfer(self, staging: Staging) -> Completion:
        """Submit the bucket's sends (trainer) or receives (worker) to the native thread in
        plan order and return at once. The completion keeps ``staging``'s buffers alive."""

    async def unpack(self, staging: Staging, sinks: Mapping[str, SinkLike]) -> None:
        """Worker, after ``wait()``: write every received piece into its sink (name -> target
        tensor, written in place, or load callback; as ``stage``). Returns when the targets
        hold the bytes.
        Trainer: nothing to do (default). A transport may cache per-bucket views of the
        targets keyed by the ``sinks`` mapping object (the engine passes the same one every
        round): pass a new mapping when the targets change, never mutate one in place.

        Cancellation: targets may be partly written; the round fails, the version is not
        advanced, and the engine is POISONED.
        """
        if self.ctx.role == "worker":
            raise NotImplementedError(f"{type(self).__name__}.unpack")

    def release(self, staging: Staging) -> None:  # noqa: B027 - optional hook
        """Give the staging memory back; called after ``unpack`` (or after a failure once the
        transport is aborted). Default: drop the references."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail-stop abort: make every pending and future native call return promptly with an
        error, never reuse the communicator. Thread-safe, idempotent, bounded, never waits on a
        peer; called by the round watchdog, by ``cancel`` paths and by ``close`` after an error.
        Implementations set ``self._abort_reason`` first (``check_usable`` reads it)."""

    @abstractmethod
    async def close(self) -> None:
        """Release everything (communicator, handles, staging, helper threads). Bounded; after
        ``abort`` it must not wait for peers. Idempotent.

        Cancellation: run it shielded (the engine does); a cancelled close may leak resources.
        """


def transport_class(name: str) -> type[Transport]:
    """The class registered as ``name``; imports it lazily. ``PlanError`` for unknown names,
    an actionable ``LocalProtocolError`` when its module cannot be imported."""
    try:
        path = TRANSPORTS[name]
    except KeyError:
        raise PlanError(f"unknown transport {name!r}; expected 'auto' or one of "
                        f"{sorted(TRANSPORTS)}") from None
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise LocalProtocolError(f"transport {name!r} is not available: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise LocalProtocolError(f"{path} is not a Transport subclass")
    return cls


def create_transport(name: str, ctx: TransportContext) -> Transport:
    """Construct the agreed transport for ``ctx`` (after the destination phase)."""
    return transport_class(name)(ctx)
