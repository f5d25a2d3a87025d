"""The ``m2n`` data plane: NVIDIA ``nccl.m2n`` reshards over one ``nccl.core`` communicator.

Theory of operation. M2N is a collective per tensor: every rank of the communicator issues
the same reshard calls in the same order with identical metadata (a mismatch hangs, it is not
detected). Here both sides walk the agreed plan's buckets in order, so the calls line up by
construction: a trainer passes its local shard as the source and ``None`` as the destination,
a worker the reverse, and both describe both meshes (``Layout.resolved()``: a fully
replicated tensor is the mesh re-factored ``(size, 1)``).

Per bucket:

* ``stage`` (loop thread, pack stream): the pack stream first waits on the producer stream
  (the caller's current stream: the optimizer's writes). A source that is already a
  contiguous CUDA tensor of the wire dtype on our device goes **zero-copy**; anything else is
  cast/made contiguous on the pack stream (the fp32 master → bf16 case). A worker receives
  **in place** into target tensors that are contiguous, of the wire dtype and on our device;
  other sinks (load callbacks, CPU or strided targets) get a staging tensor, copied or handed
  to the callback in ``unpack``. A stacked call (``_proto.stacking``) packs its members into
  one arena buffer with one multi-tensor copy, and the worker scatters it with another —
  unless the members lie back to back in one storage (a flat parameter buffer, experts as
  ``w[e]`` of one weight): then the stack is that storage, sent or received in place
  (``_span``). An event on the pack stream orders the transfer after the
  producer; casts are fenced in chunks of ``GATE_BYTES``: after each chunk an event, and the
  transfer waits for a param's own chunk only, so the first reshard starts while the rest of
  the bucket is still being cast rather than after all of it.
* ``transfer`` (native thread, transfer stream): waits on that event (and on each cast
  chunk's event before the chunk's first reshard), then either one
  ``nccl.m2n.group()`` of the bucket's reshards (split so that no group carries more than
  ``GROUP_MAX_BYTES`` of global tensor bytes: a PACK bin over 2 GiB fails unless
  ``NCCL_RESHARD_PACK_BUFFSIZES`` is raised everywhere) or the same reshards one by one, in
  the same order. Then an event; the completion fires when it completed. The ``DistTensor``
  descriptors are built on the loop thread and reused across rounds where that is safe
  (``_descriptors``): between GPUs, building them cost as much as the small reshards. They
  describe a buffer by its address, so the lane holds none of the caller's tensors (nor a
  view, nor a weak reference to one) from one round to the next.
* ``unpack`` (worker): copies staged tensors into their targets on the unpack stream (after
  the transfer event) and calls load callbacks once the bytes are there.

Grouping is decided once per generation, identically on every rank (DEVELOPERS "GPU notes":
the communicator's GIN properties cannot be queried on libnccl 2.30 with nccl4py 0.6, and on
a GIN-less host every grouped submission fails synchronously at ``group_end`` on every rank
while the communicator stays usable). ``M2N_ASYNC_M2N_GROUPING``: ``off`` never groups;
``on`` groups and fails ``connect`` if the probe fails; ``auto`` (default) probes: right after
the communicator exists every rank submits one 2-entry group of tiny reshards, then the ranks
all-gather ok/failed through the rendezvous *before* anyone waits on the GPU. All ok → grouped;
all failed → ordered single calls (``grouping_reason`` says why); mixed → abort and raise.

Fail-stop: an error after a transfer started leaves the communicator and M2N epoch unusable;
``abort`` (base class) wakes every waiter, then aborts the communicator and destroys the
handle on a daemon thread, bounded by ``close``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import anyio

from m2n_async._data._cuda import (
    GpuTransportBase,
    _torch,
    grouping_mode,
    is_tensor,
    lookup_tensor,
    m2n_module,
    torch_dtype,
)
from m2n_async._data._kernels import (
    MIN_PIECES,
    Form,
    address_align,
    contiguous_strides,
    copy_many,
    pointer_table,
    uniform_pieces,
)
from m2n_async._data._kernels import available as kernels_available
from m2n_async._data._transport import Completion, SinkLike, Staging, TransportSettings
from m2n_async._proto.errors import LocalProtocolError, PlanError, TransferError
from m2n_async._proto.plan import M2N_MAX_CALL_BYTES
from m2n_async._proto.stacking import bucket_calls, stacked_placement

if TYPE_CHECKING:
    import torch

    from m2n_async._data._transport import Rendezvous, TransportContext
    from m2n_async._proto.plan import Bucket

__all__ = ["GATE_BYTES", "GROUP_MAX_BYTES", "SOURCE_TABLES", "M2NStaging", "M2NTransport"]

log = logging.getLogger(__name__)

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_IN_PLACE = operator.attrgetter("in_place")
_TARGET = operator.attrgetter("target")

#: Largest global tensor bytes in one ``nccl.m2n.group()``: M2N's default PACK slot is 2 GiB
#: per rank and a fused bin over it fails. Global bytes bound every rank's share.
GROUP_MAX_BYTES = 2 << 30

#: Trainer casts are fenced every this many staged bytes (an event on the pack stream) and
#: each reshard waits only for its own chunk: the transfer starts after the first chunk's
#: casts instead of the whole bucket's. Large, because a fence between small reshards costs
#: more than it gains: with 4 MiB chunks a MoE-like bucket (1024 casts of 512 KiB) got 64
#: fences and its cast round ran 12-15 % slower between two H200s, while the casts of a chunk
#: this size take tens of microseconds on the GPU.
GATE_BYTES = 64 << 20

#: Source pointer tables kept per stacked call: a trainer that alternates between a few source
#: sets (bf16 copies and fp32 masters, double-buffered weights) finds each set's table again
#: instead of rebuilding it every round; each is 8 bytes per member on the device.
SOURCE_TABLES = 4


class _Param(NamedTuple):
    """Everything one reshard call needs except the buffers; identical on every rank."""

    param: int                 # index in the plan
    name: str
    dtype: Any                 # torch dtype (wire)
    nbytes: int                # global bytes
    src_mesh: Any              # nccl.m2n.Mesh
    src_placements: tuple[Any, ...]
    src_shape: tuple[int, ...]
    dst_mesh: Any
    dst_placements: tuple[Any, ...]
    dst_shape: tuple[int, ...]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Call(NamedTuple):
    """One reshard of a bucket: a single parameter, or ``len(members)`` parameters of one
    geometry stacked along a new leading dim (``_proto.stacking``). ``geo`` describes the
    tensor M2N sees (for a stack: shapes ``(k, *shape)``, shard dims shifted by one)."""

    key: int                   # the first member's plan index: names the call in caches
    geo: _Param
    members: tuple[_Param, ...]
    #: the members' sources from a mapping in one C-level call (a tuple for two or more)
    fetch: Callable[[Mapping[str, Any]], Any]
    #: the same by plan index, from a sequence in plan order (``CheckedSources``)
    pick: Callable[[Sequence[Any]], Any]

    @property
    def stacked(self) -> bool:
        return len(self.members) > 1

    @property
    def label(self) -> str:
        if not self.stacked:
            return repr(self.geo.name)
        first, last = self.members[0].name, self.members[-1].name
        return f"{first!r} .. {last!r} ({len(self.members)} stacked)"


@dataclass(eq=False)
class M2NStaging(Staging):
    """One bucket on this rank: one buffer per reshard call, in call order."""

    calls: tuple[_Call, ...] = ()
    #: trainer: source buffers; worker: destination buffers (targets or staging tensors)
    buffers: list[Any] = field(default_factory=list)
    #: worker: indices (into ``calls``) whose buffer is staging, not the target itself
    staged: list[int] = field(default_factory=list)
    ready: Any = None          # event: producer done (trainer) / targets free (worker)
    #: trainer: (first call index, event) per cast chunk, in order: the event fires when the
    #: chunk's packing is done; reshards from that call on wait for it (``GATE_BYTES``)
    gates: list[tuple[int, Any]] = field(default_factory=list)
    transferred: Any = None    # event recorded after the bucket's reshards
    zero_copy: int = 0
    #: parameters that travelled inside a stacked call
    stacked_params: int = 0
    #: stacked calls sent from / received into the caller's own storage (``_span``)
    in_place_stacks: int = 0
    #: per buffer: it outlives the round at its address (a view of a stack arena; the
    #: caller's own tensor, zero-copy), so the worker's scatter lists over it may be reused
    persistent: list[bool] = field(default_factory=list)
    #: trainer: the sources the pack stream copies from, held until the bucket is released:
    #: the copies are only enqueued, and a lazy source dropped meanwhile could be reused by
    #: the producer before they ran
    sources: list[Any] = field(default_factory=list)
    #: the stack arena slot this bucket holds (``_StackArenas``), None if none or temporary
    arena_slot: int | None = None


@dataclass(eq=False)
class _Scatter:
    """One multi-tensor copy of a worker's unpack: targets and the received views (one
    shape and dtype pair), with the kernel's pointer tables once built (``_kernels``)."""

    dsts: list[Any]
    srcs: list[Any]
    cache: bool                # the same pieces every round: tables worth keeping
    tables: tuple[Any, Any] | None = None
    kernel: bool | None = None  # the Triton copy can take the group (decided on first use)
    #: the targets' storage addresses in ``tables``: a target whose ``.data`` was reassigned
    #: (the same tensor, new storage) must not be written through the old address
    dst_ptrs: list[int] | None = None


class _StackViews(NamedTuple):
    """A bucket's stacked buffers inside one arena, built once and reused every round while
    the arena stays the same: call index -> (stacked buffer, its per-member views)."""

    arena_ptr: int
    views: dict[int, tuple[Any, tuple[Any, ...]]]


class _StackArenas:
    """One device buffer per pipeline slot for the stacked calls of a bucket, kept across
    rounds.

    Bucket ``i`` takes slot ``i % slots``: the pipeline stages at most ``max_inflight``
    buckets at once and releases them in bucket order, so that slot is free whenever bucket
    ``i`` is staged, and a bucket gets the same arena every round. That is what lets its
    stacked buffers and their per-member views (``_StackViews``), and the M2N descriptors
    over them, be built once: for 1024 experts, ``unbind`` and a descriptor per round cost
    more host time than the copies. A busy slot (a caller driving the transport deeper than
    ``max_inflight``) gets a temporary buffer instead. Memory: at most ``slots`` x the
    largest bucket's stacked bytes, held until ``close``.
    """

    def __init__(self, slots: int) -> None:
        self.slots = max(slots, 1)
        self._bufs: dict[int, Any] = {}
        self._busy: set[int] = set()

    def take(self, index: int, nbytes: int, device: Any) -> tuple[int | None, Any]:
        torch = _torch()
        slot = index % self.slots
        if slot in self._busy:
            return None, torch.empty(nbytes, dtype=torch.uint8, device=device)
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            self._bufs[slot] = buf = None  # free the smaller one first
            buf = self._bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._busy.add(slot)
        return slot, buf

    def give(self, slot: int | None) -> None:
        if slot is not None:
            self._busy.discard(slot)

    def clear(self) -> None:
        self._bufs.clear()
        self._busy.clear()


def _stack_view(first: Any, shape: tuple[int, ...]) -> Any:
    """A contiguous tensor of ``shape`` over the storage of ``first`` (a stack's first
    member), starting where ``first`` starts (``M2NTransport._span`` checked the bounds).

    Taken of ``first.detach()``: a view of ``first`` itself would hold ``first`` as its
    base while the round runs, and ``torch.utils.swap_tensors`` refuses a tensor something
    else references."""
    return first.detach().as_strided(shape, contiguous_strides(shape), first.storage_offset())


def _storage_ref(t: Any) -> Any:
    """A weak reference to ``t``'s storage (``_same_storage``). Not a weak reference to
    ``t``: ``torch.utils.swap_tensors`` (``Module.to`` under swap-on-conversion) refuses a
    tensor with any weak reference, while one to its storage leaves the tensor alone, and
    it keeps no memory of the caller's once the caller lets the storage go."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]


def _same_storage(ref: Any, t: Any) -> bool:
    """``t`` lies in the very storage ``ref`` (``_storage_ref``) was taken of, still alive.
    The reference keeps the storage object's own memory allocated while it lives, so no
    other storage can take its address in the meantime: equal means the same storage."""
    return not ref.expired() and ref.cdata == t.untyped_storage()._cdata


#: Stacked buffers start at multiples of this many bytes inside an arena (any dtype's
#: alignment, and the 256-byte alignment CUDA allocations have).
_ALIGN = 256


class M2NTransport(GpuTransportBase):
    """``nccl.m2n`` reshards, bucket by bucket (module docstring)."""

    name: ClassVar[str] = "m2n"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._m2n: Any = None
        self.handle: Any = None
        self.grouped = False
        self.grouping_reason = "not decided yet (connect has not run)"
        self._calls: dict[int, tuple[_Call, ...]] = {}
        self._moved: dict[int, int] = {}
        settings = ctx.settings
        #: 0: coalescing off (every parameter its own reshard)
        self.coalesce_below = settings.coalesce_below if settings.coalesce else 0
        # Descriptor reuse across rounds (``_descriptors``): the side this rank does not
        # take part in, per call; the side it does, per call, with the address it describes.
        self._absent_side: dict[int, Any] = {}
        self._own_side: dict[int, tuple[int, Any]] = {}
        # Stacked calls: arenas per pipeline slot, their views and the worker's scatter lists
        # per bucket, built once (``_StackArenas``).
        self._arenas = _StackArenas(ctx.settings.max_inflight)
        self._offsets: dict[int, tuple[int, dict[int, int]]] = {}
        self._views: dict[int, _StackViews] = {}
        self._scatter: dict[int, tuple[Any, Any, list[_Scatter],
                                       list[tuple[str, Any, Any]]]] = {}
        self._tables: dict[tuple[int, int, int], Any] = {}  # stack member pointer tables
        #: (bucket, call) -> the last ``SOURCE_TABLES`` (addresses, device pointer table)
        #: pairs of its sources, the latest first
        self._src_tables: dict[tuple[int, int], list[tuple[list[int], Any]]] = {}
        #: (bucket, call) -> the first member's storage (``_storage_ref``) and the members'
        #: addresses, as ``_span`` last checked them in full
        self._spans: dict[tuple[int, int], tuple[Any, list[int]]] = {}
        #: worker: (bucket, call) -> (the sink records, the members' target tensors, or None
        #: when some member is not a tensor written in place): decided once per records
        self._span_targets: dict[tuple[int, int], tuple[Any, tuple[Any, ...] | None]] = {}

    @classmethod
    def identity(cls, settings: TransportSettings) -> dict[str, str]:
        return super().identity(settings)

    # -- setup -----------------------------------------------------------------------------

    async def prepare(self) -> None:
        """runtime_ready: device, streams, and the one M2N handle of this engine (created on
        the native thread; ``max_cta`` from the settings). Local only.

        Cancellation: the handle (if created) is destroyed by ``close``.
        """
        await super().prepare()
        self._m2n = m2n_module()
        m2n = self._m2n
        cfg = m2n.Config(max_cta=self.ctx.settings.max_cta)
        try:
            self.handle = await self.ctx.native.run(m2n.Handle.create, cfg,
                                                    description="nccl.m2n Handle.create")
        except Exception as exc:
            raise self.translate(exc, "M2N handle creation") from exc
        assert self.streams is not None
        if self.streams.cuda and kernels_available():
            # The calls are described here, on the loop thread, as the first round would:
            # the thread that lists the forms only reads them (M2N's objects stay here).
            for b in self.ctx.buckets:
                self._bucket(b)
            # the stacks' copies compile now, not in the first round's pack or scatter
            await self._warm_copies(self._copy_forms)

    def _copy_forms(self) -> list[Form]:
        """The multi-tensor copies this rank's stacked calls will launch, as the plan tells
        them: a trainer packs each stack from its sources (the wire dtype, and float32
        masters cast to a 16-bit wire); a worker scatters a bucket's stack members into the
        targets written in place, one copy per member shape and dtype across the bucket's
        stacks (``_scatter_lists``; load callbacks get views). The members' alignment
        follows from their arena offsets; the caller's tensors are taken to be 16-byte
        aligned (fresh allocations are). A form missed here (less aligned sources, another
        master dtype) compiles in the round, as before."""
        torch = _torch()
        trainer = self.ctx.role == "trainer"
        in_place = self.ctx.in_place
        forms: dict[Form, None] = {}
        for b in self.ctx.buckets:
            calls = self._bucket(b)
            _, offsets = self._stack_offsets(b.index, calls)
            scatters: dict[tuple[tuple[int, ...], Any], list[int]] = {}
            for k, off in offsets.items():
                p = calls[k].geo
                member = (p.src_shape if trainer else p.dst_shape)[1:]
                step = _numel(member) * p.dtype.itemsize
                # the arena starts _ALIGN-aligned: member j lies at off + j * step
                if trainer:
                    if len(calls[k].members) < MIN_PIECES:  # left to ``_foreach_copy_``
                        continue
                    stride = contiguous_strides(member)
                    align = address_align([off, step])
                    srcs = [p.dtype]
                    if p.dtype in (torch.bfloat16, torch.float16):
                        srcs.append(torch.float32)
                    for src in srcs:
                        forms[Form(src, p.dtype, member, stride, stride, align)] = None
                else:
                    scatters.setdefault((member, p.dtype), []).extend(
                        off + j * step for j, m in enumerate(calls[k].members)
                        if in_place is None or m.param in in_place)
            for (member, dtype), addresses in scatters.items():
                if len(addresses) >= MIN_PIECES:
                    stride = contiguous_strides(member)
                    forms[Form(dtype, dtype, member, stride, stride,
                               address_align(addresses))] = None
        return list(forms)

    def _describe(self, i: int) -> _Param:
        m2n = self._m2n
        p = self.ctx.plan.params[i]
        spec = p.spec
        shape = tuple(spec.shape)

        def side(layout: Any) -> tuple[Any, tuple[Any, ...], tuple[int, ...]]:
            lay = layout.resolved()
            pl = lay.placements or (-1, -1)
            placements = tuple(m2n.Replicate() if x < 0 else m2n.Shard(x) for x in pl)
            mesh = m2n.Mesh(tuple(lay.mesh.dims), lay.mesh.start_rank)
            return mesh, placements, tuple(lay.shard_shape(shape))

        sm, sp, ss = side(spec.layout)
        dm, dp, ds = side(p.dst)
        return _Param(i, spec.name, torch_dtype(spec.dtype), spec.nbytes, sm, sp, ss, dm, dp, ds)

    def _stack(self, members: tuple[_Param, ...]) -> _Param:
        """The geometry of ``members`` (one geometry) stacked along a new dim 0."""
        m2n, p, k = self._m2n, members[0], len(members)

        def shifted(placements: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(m2n.Shard(stacked_placement(x.dim)) if isinstance(x, m2n.Shard)
                         else x for x in placements)

        return p._replace(name=f"{p.name} .. {members[-1].name}", nbytes=p.nbytes * k,
                          src_placements=shifted(p.src_placements),
                          src_shape=(k, *p.src_shape),
                          dst_placements=shifted(p.dst_placements),
                          dst_shape=(k, *p.dst_shape))

    def _bucket(self, bucket: Bucket) -> tuple[_Call, ...]:
        """The bucket's reshard calls (``_proto.stacking.bucket_calls``), described once."""
        got = self._calls.get(bucket.index)
        if got is None:
            plan = self.ctx.plan
            groups = bucket_calls(plan, bucket, coalesce_below=self.coalesce_below,
                                  max_call_bytes=M2N_MAX_CALL_BYTES)
            calls = []
            for group in groups:
                members = tuple(self._describe(i) for i in group)
                geo = self._stack(members) if len(members) > 1 else members[0]
                calls.append(_Call(group[0], geo, members,
                                   operator.itemgetter(*(m.name for m in members)),
                                   operator.itemgetter(*(m.param for m in members))))
            got = self._calls[bucket.index] = tuple(calls)
            rank = self.ctx.rank
            moved = 0
            for i in range(bucket.start, bucket.stop):
                for piece in self.ctx.plan.pieces(i):
                    if rank in (piece.src_rank, piece.dst_rank):
                        moved += piece.nbytes
            self._moved[bucket.index] = moved
        return got

    @property
    def detail(self) -> str:
        stacking = (f"parameters below {self.coalesce_below} bytes of one geometry stacked "
                    f"into one reshard" if self.coalesce_below else "coalescing off")
        return f"m2n submission: {self.grouping_reason}; {stacking}"

    async def _after_connect(self, rendezvous: Rendezvous) -> None:
        await self._decide_grouping(rendezvous)
        log.info("rank %d: %s", self.ctx.rank, self.detail)

    async def _decide_grouping(self, rendezvous: Rendezvous) -> None:
        mode = grouping_mode()
        if mode == "off":
            self.grouped = False
            self.grouping_reason = "off (M2N_ASYNC_M2N_GROUPING=off): ordered single reshards"
            return
        try:
            with anyio.fail_after(rendezvous.timeout):
                ok, error, keep = await self.ctx.native.run(
                    self._probe_group, description="nccl.m2n grouping probe")
                votes = await rendezvous.all_gather(
                    b"1" if ok else error.encode()[:500] or b"0", name="m2n-grouping")
        except TimeoutError:
            self.abort("M2N grouping probe timed out")
            raise TimeoutError(
                f"m2n: the grouping probe did not finish within "
                f"{rendezvous.timeout}s at {self.ctx.where()}; set "
                f"M2N_ASYNC_M2N_GROUPING=off on every rank to skip it") from None
        failed = {r: v.decode(errors="replace") for r, v in enumerate(votes) if v != b"1"}
        if not failed:
            # Every rank launched the probe group; wait for it (bounded) so the communicator
            # is quiet before the first round.
            completion = self.completion_of(keep["event"], keep, "grouping probe")
            with anyio.fail_after(rendezvous.timeout):
                await completion.wait()
            if keep["check"] is not None and not keep["check"]():
                self.abort("M2N grouping probe delivered wrong bytes")
                raise TransferError(f"m2n: the grouping probe delivered wrong bytes at "
                                    f"{self.ctx.where()}", rank=self.ctx.rank)
            self.grouped = True
            self.grouping_reason = f"{mode}: nccl.m2n.group() probe succeeded on every rank"
            return
        first = min(failed)
        if mode == "on":
            self.abort("M2N grouping required but unsupported")
            raise LocalProtocolError(
                f"m2n: M2N_ASYNC_M2N_GROUPING=on but grouped submission failed on ranks "
                f"{sorted(failed)} (rank {first}: {failed[first]}); set it to 'auto' or "
                f"'off' at {self.ctx.where()}")
        if len(failed) < self.ctx.world_size:
            self.abort("M2N grouping probe failed on some ranks only")
            raise TransferError(
                f"m2n: the grouping probe failed on ranks {sorted(failed)} but succeeded on "
                f"the others, so the communicator may hold half a collective; aborted. "
                f"Set M2N_ASYNC_M2N_GROUPING=off on every rank (rank {first}: "
                f"{failed[first]}) at {self.ctx.where()}", rank=self.ctx.rank)
        self.grouped = False
        self.grouping_reason = (f"auto: nccl.m2n.group() fails on this host (rank {first}: "
                                f"{failed[first]}); ordered single reshards")

    def _probe_group(self) -> tuple[bool, str, dict[str, Any]]:
        """Native thread: one group of two tiny reshards (trainers Shard(0) → workers fully
        replicated), disjoint buffers. Returns (ok, error, buffers/event to keep)."""
        torch = _torch()
        m2n = self._m2n
        t, n, rank = self.ctx.trainer_ranks, self.ctx.world_size - self.ctx.trainer_ranks, \
            self.ctx.rank
        dev = self.device
        per = 16
        src_mesh, dst_mesh = m2n.Mesh((t, 1), 0), m2n.Mesh((n, 1), t)
        srcs: list[Any] = []
        dsts: list[Any] = []
        for k in range(2):
            if rank < t:
                srcs.append(torch.arange(per, dtype=torch.int32, device=dev) + rank * per
                            + k * 1000)
                dsts.append(None)
            else:
                srcs.append(None)
                dsts.append(torch.full((t * per,), -1, dtype=torch.int32, device=dev))
        assert self.streams is not None
        stream = self.streams.transfer
        self.streams.wait(stream, self.streams.producer())
        keep: dict[str, Any] = {"srcs": srcs, "dsts": dsts, "event": None, "check": None}
        try:
            with m2n.group():
                for k in range(2):
                    self.handle.reshard(
                        self.comm,
                        m2n.DistTensor(srcs[k], (per,), torch.int32, mesh=src_mesh,
                                       placements=(m2n.Shard(0), m2n.Replicate())),
                        m2n.DistTensor(dsts[k], (t * per,), torch.int32, mesh=dst_mesh,
                                       placements=(m2n.Replicate(), m2n.Replicate())),
                        stream=self.streams.ptr(stream))
        except Exception as exc:
            try:
                m2n.group_abort()  # group state is per thread: leave none behind
            except Exception:
                pass
            detail = getattr(exc, "detail", None) or str(exc)
            return False, f"{type(exc).__name__}: {detail}"[:400], keep
        keep["event"] = self.streams.record(stream)
        if rank >= t:
            def check() -> bool:
                want = [torch.arange(t * per, dtype=torch.int32, device=dev) + k * 1000
                        for k in range(2)]
                return all(bool(torch.equal(d, w)) for d, w in zip(dsts, want, strict=True))

            keep["check"] = check
        return True, "", keep

    # -- rounds -----------------------------------------------------------------------------

    def _zero_copy_ok(self, t: Any, p: _Param, shape: tuple[int, ...]) -> bool:
        """Tensor ``t`` can be the call's buffer itself (the caller knows it is a tensor)."""
        return (t.device == self.device and t.dtype == p.dtype
                and t.is_contiguous() and tuple(t.shape) == shape)

    async def stage(self, bucket: Bucket, *,
                    sources: Mapping[str, torch.Tensor] | None = None,
                    sinks: Mapping[str, SinkLike] | None = None) -> Staging:
        """See ``Transport.stage``: per call, zero-copy sources/targets where possible, else a
        cast or staging tensor on the pack stream; a stacked call packs its members with one
        multi-tensor copy (the Triton copy or ``torch._foreach_copy_``, the cast included),
        or none when they lie back to back in one storage (``_span``). Records the events
        the transfer waits on.

        Cancellation: nothing was submitted; the staging is dropped with the round.
        """
        self.check_usable()
        streams = self.streams
        assert streams is not None
        calls = self._bucket(bucket)
        st = M2NStaging(bucket, calls=calls, nbytes_moved=self._moved[bucket.index])
        producer = streams.producer()
        where = self.ctx.where(bucket=bucket.index)  # once: a bucket may hold 10^4 params
        if self.ctx.role == "trainer":
            if sources is None:
                raise LocalProtocolError(f"m2n: trainer stage without sources at {where}")
            streams.wait(streams.pack, producer)
            # zero-copy sources only need the producer: this event, before any cast
            st.ready = streams.record(streams.pack)
            with streams.on(streams.pack):
                self._pack(st, sources, where)
        else:
            if sinks is None:
                raise LocalProtocolError(f"m2n: worker stage without sinks at {where}")
            records = self.sink_records(sinks)
            torch = _torch()
            with streams.on(streams.pack):
                stacks = None  # the arena is taken only if some stack needs staging
                for k, call in enumerate(calls):
                    p = call.geo
                    if call.stacked:
                        span = self._target_span(st.bucket.index, k, call, records)
                        if span is not None:  # received straight into the targets
                            st.buffers.append(span)
                            st.persistent.append(False)
                            st.in_place_stacks += 1
                            st.stacked_params += len(call.members)
                            continue
                        try:  # a missing target fails before the transfer
                            call.fetch(records)  # one C-level lookup of every member
                        except KeyError:
                            for m in call.members:  # raises the error naming it
                                lookup_tensor(records, m.name, where)
                            raise
                        if stacks is None:
                            stacks = self._stacks(st)
                        buf = stacks[k][0]
                        st.buffers.append(buf)
                        st.persistent.append(st.arena_slot is not None)
                        st.staged.append(k)
                        st.stacked_params += len(call.members)
                        st.nbytes += buf.numel() * buf.element_size()
                        continue
                    sink = lookup_tensor(records, p.name, where)
                    if sink.in_place and self._zero_copy_ok(sink.target, p, p.dst_shape):
                        st.buffers.append(sink.target)
                        st.persistent.append(True)
                        st.zero_copy += 1
                        continue
                    buf = torch.empty(p.dst_shape, dtype=p.dtype, device=self.device)
                    st.buffers.append(buf)
                    st.persistent.append(False)
                    st.staged.append(k)
                    st.nbytes += buf.numel() * buf.element_size()
            # Targets are written in place: the transfer must follow any queued reader.
            st.ready = streams.record(producer)
        return st

    def _stack_offsets(self, bucket_index: int, calls: tuple[_Call, ...]
                       ) -> tuple[int, dict[int, int]]:
        """Bytes of the bucket's stacked buffers on this side and each one's arena offset."""
        got = self._offsets.get(bucket_index)
        if got is None:
            trainer = self.ctx.role == "trainer"
            offsets: dict[int, int] = {}
            total = 0
            for k, call in enumerate(calls):
                if call.stacked:
                    p = call.geo
                    shape = p.src_shape if trainer else p.dst_shape
                    offsets[k] = total
                    n = _numel(shape) * p.dtype.itemsize
                    total += -(-n // _ALIGN) * _ALIGN
            got = self._offsets[bucket_index] = (total, offsets)
        return got

    def _stacks(self, st: M2NStaging) -> dict[int, tuple[Any, tuple[Any, ...]]]:
        """This bucket's stacked buffers (call index -> buffer, member views) in its arena
        slot, reused from the last round when it got the same arena."""
        total, offsets = self._stack_offsets(st.bucket.index, st.calls)
        if not offsets:
            return {}
        slot, arena = self._arenas.take(st.bucket.index, total, self.device)
        st.arena_slot = slot
        ptr = arena.data_ptr()
        cached = self._views.get(st.bucket.index) if slot is not None else None
        if cached is not None and cached.arena_ptr == ptr:
            return cached.views
        trainer = self.ctx.role == "trainer"
        views: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        for k, off in offsets.items():
            p = st.calls[k].geo
            shape = p.src_shape if trainer else p.dst_shape
            n = _numel(shape) * p.dtype.itemsize
            buf = arena[off:off + n].view(p.dtype).view(shape)
            views[k] = (buf, buf.unbind(0))
        if slot is not None:
            self._views[st.bucket.index] = _StackViews(ptr, views)
        return views

    def _table(self, st: M2NStaging, k: int, parts: tuple[Any, ...]) -> Any:
        """The device pointer table of call ``k``'s member views (``_kernels``), built once
        per arena; None when the kernel is unavailable or the buffer is temporary."""
        if st.arena_slot is None or not kernels_available() or not parts[0].is_cuda:
            return None
        key = (st.bucket.index, k, parts[0].data_ptr())
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = pointer_table(parts, self.device)
        return table

    def _source_table(self, st: M2NStaging, k: int, srcs: tuple[Any, ...], ptrs: list[int]
                      ) -> Any:
        """The device pointer table of call ``k``'s sources (at addresses ``ptrs``): one of the
        last ``SOURCE_TABLES`` rounds' when every source is where it was then (reading 1024
        addresses costs ~80 us; building and uploading a new table 0.2-0.6 ms more on the
        H200 host), else a new one. None without the kernel. The staging keeps the table
        until the copy ran."""
        if not kernels_available() or not srcs[0].is_cuda:
            return None
        key = (st.bucket.index, k)
        seen = self._src_tables.setdefault(key, [])
        hit = next((i for i, (old, _) in enumerate(seen) if old == ptrs), None)
        if hit is None:
            table = pointer_table(srcs, self.device, ptrs)
            seen.insert(0, (ptrs, table))
            del seen[SOURCE_TABLES:]
        else:
            table = seen[hit][1]
            if hit:  # the latest first: a steady source set is found at once
                seen.insert(0, seen.pop(hit))
        st.sources.append(table)
        return table

    def _span(self, key: tuple[int, int], tensors: tuple[Any, ...], ptrs: list[int],
              shape: tuple[int, ...], dtype: Any) -> Any | None:
        """The stacked buffer of call ``key`` over its members' own bytes, when the members
        (``tensors``, at addresses ``ptrs``) lie back to back in stack order inside one
        storage, contiguous, of the member shape ``shape[1:]`` and ``dtype``, on this device:
        then the reshard reads (trainer) or writes (worker) them in place, with no pack or
        scatter copy. That is the layout of a trainer's flat parameter buffer (Megatron's
        DDP keeps the parameters as views of one) and of experts addressed as ``w[e]`` of
        one stacked weight. Else None.

        Checked in full once; after that, while the first member lies in the very storage
        checked (``_same_storage``) and the members at the same addresses, the view is only
        rebuilt: the engine checks every member's dtype, shape, device and contiguity each
        round, and no other storage can take those addresses while that one lives. The
        view is the round's own: one kept across rounds would hold the caller's storage
        after the caller let it go (a lazily cast source, weights offloaded between rounds).
        """
        k = len(tensors)
        step = _numel(shape[1:]) * dtype.itemsize
        first = ptrs[0]
        if ptrs[-1] - first != (k - 1) * step or ptrs != list(range(first, first + k * step,
                                                                    step)):
            self._spans.pop(key, None)
            return None
        t0 = tensors[0]
        hit = self._spans.get(key)
        if hit is not None and hit[1] == ptrs and _same_storage(hit[0], t0):
            return _stack_view(t0, shape)
        # Checked in full whenever the storage is not the one checked: the members may
        # have been given storage of their own at the very same addresses (a freed block
        # split by the allocator).
        if not (t0.device == self.device
                and all(map(operator.is_, map(_DTYPE, tensors), repeat(dtype)))
                and all(map(_torch().Tensor.is_contiguous, tensors))
                and all(map(operator.eq, map(_SHAPE, tensors), repeat(shape[1:])))):
            self._spans.pop(key, None)
            return None
        storage = t0.untyped_storage()  # adjacent blocks of two allocations do not count
        base = storage.data_ptr()
        if not base <= first <= first + k * step <= base + storage.nbytes():
            self._spans.pop(key, None)
            return None
        self._spans[key] = (_storage_ref(t0), ptrs)
        return _stack_view(t0, shape)

    def _target_span(self, bucket: int, k: int, call: _Call, records: Mapping[str, Any]
                     ) -> Any | None:
        """Worker: ``_span`` over the targets of stacked call ``k``, when every member's sink
        is a tensor written in place. Which members' targets those are is decided once per
        records mapping (the engine's is fixed at connect); their addresses are read every
        round, so a target given new storage is seen."""
        key = (bucket, k)
        hit = self._span_targets.get(key)
        if hit is None or hit[0] is not records:
            try:
                sinks = call.fetch(records)
            except KeyError:  # the staged path names the missing parameter
                sinks = None
            tensors = (tuple(map(_TARGET, sinks))
                       if sinks is not None and all(map(_IN_PLACE, sinks)) else None)
            hit = self._span_targets[key] = (records, tensors)
        tensors = hit[1]
        if tensors is None:
            self._spans.pop(key, None)
            return None
        ptrs = list(map(_torch().Tensor.data_ptr, tensors))  # the C method: one C-level pass
        return self._span(key, tensors, ptrs, call.geo.dst_shape, call.geo.dtype)

    def _pack(self, st: M2NStaging, sources: Mapping[str, torch.Tensor], where: str) -> None:
        """Trainer, on the pack stream: one buffer per call. Casts are fenced every
        ``GATE_BYTES`` of staged bytes (module doc)."""
        torch = _torch()
        streams = self.streams
        assert streams is not None
        stacks = None  # the arena is taken only if some stack needs packing
        chunk_start, chunk_bytes = -1, 0
        checked = self.for_sources(sources)
        for k, call in enumerate(st.calls):
            p = call.geo
            if call.stacked:
                # The engine checked every source (``Transport.stage``): the planned local
                # shape, contiguous, on this device, an accepted dtype. So no Python per
                # member here: one itemgetter, one C-level dtype count (1024 experts: the
                # per-member checks this replaces cost ~0.7 ms of host time before the
                # reshard could be submitted). With the round's ``CheckedSources``, the
                # members and their dtypes come by plan index: no lookup by name, and no
                # dtype read from a tensor.
                if checked is not None:
                    srcs, dtypes = call.pick(checked.tensors), call.pick(checked.dtypes)
                else:
                    try:
                        srcs = call.fetch(sources)
                    except KeyError:
                        for m in call.members:  # raises the PlanError naming the parameter
                            lookup_tensor(sources, m.name, where)
                        raise
                    dtypes = tuple(map(_DTYPE, srcs))
                wire = p.dtype
                same = sum(map(operator.is_, dtypes, repeat(wire)))
                casts = len(srcs) - same
                ptrs = list(map(torch.Tensor.data_ptr, srcs))  # the C method: no frame per call
                if casts:
                    self._spans.pop((st.bucket.index, k), None)
                    span = None
                else:
                    span = self._span((st.bucket.index, k), srcs, ptrs, p.src_shape, wire)
                if span is not None:  # sent from the sources themselves: nothing to pack
                    st.buffers.append(span)
                    st.persistent.append(False)
                    st.in_place_stacks += 1
                    st.stacked_params += len(srcs)
                    continue
                if stacks is None:
                    stacks = self._stacks(st)
                st.sources.extend(srcs)
                buf, parts = stacks[k]
                st.cast_bytes += casts * (buf.numel() // len(srcs)) * buf.element_size()
                # one multi-tensor copy packs (and casts) every member: per-tensor copy_
                # launches cost ~9 us each, which is the whole budget of a small expert;
                # one Triton launch where it can (``_kernels``: 7x faster than foreach);
                # one dtype pair makes the pieces uniform (one shape and contiguity: checked)
                first = dtypes[0]
                uniform = (first is wire and not casts) or all(
                    map(operator.is_, dtypes, repeat(first)))
                if not (uniform
                        and copy_many(parts, srcs,
                                      src_table=self._source_table(st, k, srcs, ptrs),
                                      dst_table=self._table(st, k, parts), uniform=True)):
                    torch._foreach_copy_(parts, list(srcs), non_blocking=True)
                st.stacked_params += len(srcs)
                st.persistent.append(st.arena_slot is not None)
            else:
                t = lookup_tensor(sources, p.name, where)
                if is_tensor(t) and self._zero_copy_ok(t, p, p.src_shape):
                    st.buffers.append(t)
                    st.persistent.append(True)
                    st.zero_copy += 1
                    continue
                if tuple(t.shape) != p.src_shape:
                    raise PlanError(f"parameter {p.name!r}: local source shape "
                                    f"{tuple(t.shape)} but the plan says {p.src_shape} "
                                    f"at {where}")
                buf = t.to(device=self.device, dtype=p.dtype, non_blocking=True).contiguous()
                st.sources.append(t)
                if t.dtype != p.dtype:
                    st.cast_bytes += buf.numel() * buf.element_size()
                st.persistent.append(False)
            st.buffers.append(buf)
            nbytes = buf.numel() * buf.element_size()
            st.nbytes += nbytes
            if chunk_start < 0:
                chunk_start = k
            chunk_bytes += nbytes
            if chunk_bytes >= GATE_BYTES:
                st.gates.append((chunk_start, streams.record(streams.pack)))
                chunk_start, chunk_bytes = -1, 0
        if chunk_start >= 0:
            st.gates.append((chunk_start, streams.record(streams.pack)))

    def _runs(self, calls: tuple[_Call, ...]) -> list[tuple[int, int]]:
        """[start, stop) call index runs submitted as one group each (identical on every
        rank: computed from global bytes only)."""
        if not self.grouped:
            return [(k, k + 1) for k in range(len(calls))]
        runs: list[tuple[int, int]] = []
        start, acc = 0, 0
        for k, call in enumerate(calls):
            nbytes = call.geo.nbytes
            if k > start and acc + nbytes > GROUP_MAX_BYTES:
                runs.append((start, k))
                start, acc = k, 0
            acc += nbytes
        if calls:
            runs.append((start, len(calls)))
        return runs

    def _descriptors(self, st: M2NStaging) -> list[tuple[Any, Any]]:
        """(src, dst) ``DistTensor`` pairs of the bucket's calls, built on the loop thread so
        that the native thread does nothing but the native calls, in plan order.

        Building a ``DistTensor`` costs tens of µs of Python, as much as an M2N call between
        GPUs moves in a small tensor, so descriptors are reused across rounds: the absent side
        (``None`` buffer) always; the own side while its buffer is at the same address. The
        own side describes its buffer by that address (a raw pointer, which ``DistTensor``
        takes with the shape and dtype given): it is then the same descriptor whatever
        tensor lies there, and it holds no tensor, so nothing of the caller's is kept alive
        past the round. The staging holds the buffers while the reshards run."""
        trainer = self.ctx.role == "trainer"
        out = []
        for call, buf in zip(st.calls, st.buffers, strict=True):
            absent = self._absent_side.get(call.key)
            if absent is None:
                absent = self._side(None, call.geo, src=not trainer)
                self._absent_side[call.key] = absent
            own = self._own_side_of(call, buf, trainer)
            out.append((own, absent) if trainer else (absent, own))
        return out

    def _side(self, buf: int | None, p: _Param, *, src: bool) -> Any:
        """The ``DistTensor`` of ``p``'s source (``src``) or destination side at address
        ``buf`` (None: the side this rank takes no part in)."""
        if src:
            return self._m2n.DistTensor(buf, p.src_shape, p.dtype, mesh=p.src_mesh,
                                        placements=p.src_placements)
        return self._m2n.DistTensor(buf, p.dst_shape, p.dtype, mesh=p.dst_mesh,
                                    placements=p.dst_placements)

    def _own_side_of(self, call: _Call, buf: Any, trainer: bool) -> Any:
        key = call.key
        p = call.geo
        shape = p.src_shape if trainer else p.dst_shape
        # The descriptor names an address only, and M2N reads or writes ``shape`` elements
        # of ``p.dtype`` there: a buffer of another size or kind (a bug here, never the
        # caller's: the sources and targets were checked) would be overrun, not refused.
        if buf.dtype != p.dtype or buf.shape != shape or not buf.is_contiguous():
            raise LocalProtocolError(
                f"m2n: the buffer of reshard {call.label} is {buf.dtype} {tuple(buf.shape)}"
                f"{'' if buf.is_contiguous() else ', not contiguous'}, where the reshard "
                f"moves {p.dtype} {shape}")
        ptr = buf.data_ptr()
        hit = self._own_side.get(key)
        if hit is not None and hit[0] == ptr:
            return hit[1]
        desc = self._side(ptr, call.geo, src=trainer)
        self._own_side[key] = (ptr, desc)
        return desc

    def transfer(self, staging: Staging) -> Completion:
        """Submit the bucket's reshards on the native thread (grouped or one by one, in plan
        order) and return a completion that fires when the transfer stream passed them."""
        assert isinstance(staging, M2NStaging)
        st = staging
        m2n, handle, streams = self._m2n, self.handle, self.streams
        assert streams is not None
        runs = self._runs(st.calls)
        where = self.ctx.where(round=self.round, bucket=st.bucket.index)
        descs = self._descriptors(st)
        labels = [call.label for call in st.calls]
        gates = st.gates

        def run() -> Any:
            comm, stream, sptr = self.begin_transfer(st.ready, where)
            k, g = 0, 0
            try:
                for a, b in runs:
                    # the packing of every chunk that starts before this run's end
                    while g < len(gates) and gates[g][0] < b:
                        streams.wait(stream, gates[g][1])
                        g += 1
                    if b - a > 1:
                        k = a
                        with m2n.group():
                            for src, dst in descs[a:b]:
                                handle.reshard(comm, src, dst, stream=sptr)
                    else:
                        for k in range(a, b):
                            src, dst = descs[k]
                            handle.reshard(comm, src, dst, stream=sptr)
            except Exception as exc:
                raise TransferError(
                    f"m2n: reshard of param {labels[k]} failed at {where}: "
                    f"{getattr(exc, 'detail', None) or exc}",
                    rank=self.ctx.rank, round=self.round) from exc
            st.transferred = streams.record(stream)
            return st.transferred

        return self.submit(run, st, f"bucket {st.bucket.index} transfer")

    async def unpack(self, staging: Staging, sinks: Mapping[str, SinkLike]) -> None:
        """Worker: copy staged tensors into their targets with one multi-tensor copy (unpack
        stream, after the transfer event) and call load callbacks in plan order once the
        bytes are in place; a stacked call's members reach callbacks as views of the stack
        (no extra copy).

        Cancellation: targets may be partly written; the engine aborts and poisons.
        """
        if self.ctx.role == "trainer":
            return
        assert isinstance(staging, M2NStaging)
        st = staging
        streams = self.streams
        assert streams is not None
        torch = _torch()
        groups, callbacks = self._scatter_lists(st, sinks)
        streams.wait(streams.unpack, st.transferred)
        if groups:
            data_ptr = torch.Tensor.data_ptr  # the C method: one C-level pass per group
            with streams.on(streams.unpack):
                for g in groups:
                    ptrs = list(map(data_ptr, g.dsts)) if g.dst_ptrs is not None else None
                    if ptrs is not None and ptrs != g.dst_ptrs:
                        g.kernel = g.tables = g.dst_ptrs = None  # a target moved: decide again
                    if g.kernel is None:  # decided once per group (it is cached with it)
                        g.kernel = (len(g.dsts) >= MIN_PIECES and kernels_available()
                                    and uniform_pieces(g.dsts) and uniform_pieces(g.srcs))
                        if g.kernel and g.cache:
                            if ptrs is None:
                                ptrs = list(map(data_ptr, g.dsts))
                            g.tables = (pointer_table(g.srcs, self.device),
                                        pointer_table(g.dsts, self.device, ptrs))
                            g.dst_ptrs = ptrs
                    src_t, dst_t = g.tables if g.tables is not None else (None, None)
                    if not (g.kernel and copy_many(g.dsts, g.srcs, src_table=src_t,
                                                   dst_table=dst_t, uniform=True)):
                        torch._foreach_copy_(g.dsts, g.srcs, non_blocking=True)
        await self.finish_unpack(st, bool(groups), callbacks)

    def _scatter_lists(self, st: M2NStaging, sinks: Mapping[str, SinkLike]
                       ) -> tuple[list[_Scatter], list[tuple[str, Any, Any]]]:
        """Worker: the bucket's copies (grouped by shape and dtypes: each group one
        multi-tensor copy) and load callbacks. When the bucket's buffers are all arena
        views and ``sinks`` is the mapping of the last round (the engine passes its own,
        fixed at connect), last round's are reused: building them walks every member
        (1024 experts: ~0.5 ms of host time)."""
        key = st.bucket.index
        reusable = bool(st.staged) and all(st.persistent[k] for k in st.staged)
        # which calls were staged is part of the key: a stack received in place one round
        # (``_span``) may need its scatter the next
        mark = (tuple(st.staged), st.buffers[st.staged[0]].data_ptr()) if reusable else None
        if reusable:
            hit = self._scatter.get(key)
            if hit is not None and hit[0] is sinks and hit[1] == mark:
                return hit[2], hit[3]
        records = self.sink_records(sinks)
        callbacks: list[tuple[str, Any, Any]] = []
        groups: dict[tuple[Any, ...], _Scatter] = {}
        for k in st.staged:
            call = st.calls[k]
            buf = st.buffers[k]
            parts = self._views[key].views[k][1] if call.stacked and st.persistent[k] else (
                buf.unbind(0) if call.stacked else (buf,))
            for m, part in zip(call.members, parts, strict=True):
                sink = records[m.name]
                if sink.in_place:
                    dst = sink.tensor
                    gkey = (tuple(part.shape), part.dtype, dst.dtype)
                    g = groups.get(gkey)
                    if g is None:
                        g = groups[gkey] = _Scatter([], [], reusable)
                    g.dsts.append(dst)
                    g.srcs.append(part)
                else:
                    callbacks.append((m.name, sink.target, part))
        # Callbacks run in plan order (the LoadCallback contract): calls are sorted by their
        # first member, but a stack's later members interleave with other calls.
        if len(callbacks) > 1:
            order = {m.name: m.param for call in st.calls for m in call.members}
            callbacks.sort(key=lambda c: order[c[0]])
        out = list(groups.values())
        if reusable:
            self._scatter[key] = (sinks, mark, out, callbacks)
        return out, callbacks

    def release(self, staging: Staging) -> None:
        if isinstance(staging, M2NStaging):
            self._arenas.give(staging.arena_slot)
            staging.arena_slot = None
            staging.buffers = []
            staging.sources = []
            staging.gates = []
            staging.ready = staging.transferred = None

    def _release_native_resources(self) -> list[Any]:
        self._own_side.clear()
        self._scatter.clear()
        self._tables.clear()
        self._src_tables.clear()
        self._spans.clear()
        self._span_targets.clear()
        self._views.clear()
        self._arenas.clear()
        handle, self.handle = self.handle, None
        if handle is None:
            return []
        return [handle.destroy]
