"""The ``nccl`` data plane: the packing planner's per-peer buffers over ``nccl.core`` send/recv.

Theory of operation. ``_packing.plan_bucket`` turns the agreed plan into, per bucket and per
peer, one contiguous byte buffer: the concatenation of this rank's pieces for that peer in
(parameter, piece) order. Sender and receiver derive the same segments from the plan alone,
so one ``send`` of N bytes always meets one ``recv`` of N bytes, and nothing about the layout
travels. Everything moves as ``uint8``: any fixed-width dtype (bool, int16, two shard axes,
rank > 3 — whatever M2N cannot express) is bit-exact by construction, and it works on stock
NCCL (>= 2.28, PyTorch's default) because only point-to-point calls are used.

Per bucket:

* ``stage`` (loop thread, pack stream, after waiting on the producer stream): a trainer, for
  each peer, either sends a byte range of the source directly (**zero-copy**: the peer's
  buffer is one contiguous segment of a source already in the wire dtype) or packs the
  segments into one staging arena for the bucket — every packed segment of every peer in ONE
  multi-tensor copy (``_packing.pack_pair`` / ``foreach_copy``), which also casts a source
  of another float dtype to the wire dtype (fp32 master → bf16: no cast copy of the shard
  first, the arena is the only extra memory). A worker receives directly into a contiguous
  byte range of a target tensor when the peer's buffer is one contiguous segment of it
  (**in place**), else into the arena.
* ``transfer`` (native thread, transfer stream): one ``nccl.core.group()`` holding every send
  (trainer) or recv (worker) of the bucket, in ascending peer order; then a blocking-sync
  event the completion waits on.
* ``unpack`` (worker, unpack stream after the transfer event): scatters arena segments into the
  targets' byte views (or into a temporary local shard for targets that cannot be written as
  bytes, and for load callbacks whose shard arrives in several pieces) with one multi-tensor
  copy, then copies the temporaries into their targets (one more) and calls load callbacks in
  plan order; a callback whose shard arrives whole, in one message, gets a view of the arena.

Memory: the arena is ``Staging.nbytes`` (at most the bucket's bytes for this rank: a cast
source's pieces are staged there instead of moving zero-copy); a source that had to be moved
to our device or made contiguous counts too (the engine hands in neither), so does the
temporary of a cast segment at an offset not aligned to the wire dtype (``_packing``), held
until release, and so do the temporaries above: a callback's shard gathered from several
peers is staged twice. Abort and
close are the base class's (bounded communicator abort on a daemon thread; DEVELOPERS "GPU notes":
an NCCL recv from a dead peer returns after abort).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from m2n_async._data._cuda import (
    GpuTransportBase,
    _torch,
    lookup_tensor,
    torch_dtype,
)
from m2n_async._data._kernels import MIN_PIECES, Form, address_align
from m2n_async._data._packing import (
    BucketPacking,
    byte_view,
    foreach_copy,
    kernel_groups,
    pack_pair,
    plan_bucket,
    unpack_pair,
)
from m2n_async._data._transport import Completion, SinkLike, Staging
from m2n_async._proto.errors import LocalProtocolError, PlanError, TransferError

if TYPE_CHECKING:
    import torch

    from m2n_async._data._transport import TransportContext
    from m2n_async._proto.plan import Bucket

__all__ = ["NcclStaging", "NcclTransport"]


@dataclass(eq=False)
class NcclStaging(Staging):
    """One bucket on this rank: per-peer byte buffers in ascending peer order."""

    packing: BucketPacking | None = None
    #: (peer, flat uint8 tensor) in wire order: arena slices or zero-copy views
    wires: list[tuple[int, Any]] = field(default_factory=list)
    #: worker: peers (indices into ``packing.peers``) whose bytes must be scattered
    scatter: list[int] = field(default_factory=list)
    #: worker: param index -> byte view to scatter into (target or temporary local shard)
    dst_bytes: dict[int, Any] = field(default_factory=dict)
    #: worker: (param index, temporary local shard) to copy into / hand to the sink
    temps: list[tuple[int, Any]] = field(default_factory=list)
    #: worker: load-callback params that arrive as ONE whole segment of a packed peer
    #: buffer: param index -> (index into ``packing.peers``, segment); handed an arena view
    from_arena: dict[int, tuple[int, Any]] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)   # sources, arena, cast temporaries
    ready: Any = None
    transferred: Any = None
    zero_copy: int = 0



def _arena_views(peers: list[Any]) -> list[Any]:
    """Each of ``peers``' slice of one meta arena, back to back in their order, as ``stage``
    lays the packed peers out (``NcclTransport._copy_forms``)."""
    torch = _torch()
    arena = torch.empty(sum(pb.nbytes for pb in peers), dtype=torch.uint8, device="meta")
    out, off = [], 0
    for pb in peers:
        out.append(arena[off:off + pb.nbytes])
        off += pb.nbytes
    return out


class NcclTransport(GpuTransportBase):
    """Packed per-peer buffers over grouped ``nccl.core`` send/recv (module docstring)."""

    name: ClassVar[str] = "nccl"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._packings: dict[int, BucketPacking] = {}
        #: worker, per bucket: param -> (peer index, segment) of the params that arrive whole
        #: in one packed message (a load callback then gets a view of the arena)
        self._whole: dict[int, dict[int, tuple[int, Any]]] = {}

    async def prepare(self) -> None:
        """runtime_ready: the base class's, then the packing copies' kernel variants compiled
        on a thread, not in the first round on the event loop (``_kernels.Form``)."""
        await super().prepare()
        await self._warm_copies(self._copy_forms)

    def _copy_forms(self) -> list[Form]:
        """The multi-tensor copies this rank's buckets will launch, found by pairing every
        segment as ``stage`` and ``unpack`` do, over meta tensors: a trainer packs sources
        of the wire dtype, and float32 masters cast to a 16-bit wire; a worker scatters into
        targets written in place. Arenas start 512-byte aligned (the allocator's blocks), the
        caller's tensors are taken to be 16-byte aligned. A form missed here (less aligned
        tensors, another master dtype, a load callback's shard) compiles in its round."""
        torch = _torch()
        plan = self.ctx.plan
        copies: list[list[tuple[Any, Any]]] = []  # each one ``foreach_copy`` of a stage
        for bucket in self.ctx.buckets:
            pk = self._packing(bucket)
            shard: dict[int, tuple[tuple[int, ...], Any]] = {}
            for i in pk.params:
                p = plan.params[i]
                layout = p.spec.layout if pk.sending else p.dst
                shard[i] = (tuple(layout.shard_shape(tuple(p.spec.shape))),
                            torch_dtype(p.spec.dtype))
            if pk.sending:
                for masters in (False, True):
                    cast = {i for i, (_, w) in shard.items()
                            if masters and w in (torch.bfloat16, torch.float16)}
                    if masters and not cast:
                        continue
                    local = {i: torch.empty(shape, device="meta", dtype=torch.float32
                                            if i in cast else w)
                             for i, (shape, w) in shard.items()}
                    packed = [pb for pb in pk.peers  # as ``stage``: the rest is zero-copy
                              if pb.direct is None or pb.direct.param in cast]
                    copies.append([pack_pair(view, seg, local[seg.param],
                                             shard[seg.param][1], temps=[])
                                   for pb, view in zip(packed, _arena_views(packed),
                                                       strict=True)
                                   for seg in pb.segments])
            else:
                # as ``stage``: a load callback's shard that arrives whole is handed a view
                # of the arena (no copy); one in several pieces is gathered into a temporary
                in_place = self.ctx.in_place
                whole = self._whole_segments(bucket.index, pk)
                dst_bytes = {i: byte_view(torch.empty(shape, dtype=w, device="meta"))
                             for i, (shape, w) in shard.items()}
                packed = [pb for pb in pk.peers if pb.direct is None]  # the rest in place
                copies.append([unpack_pair(view, seg, dst_bytes[seg.param])
                               for pb, view in zip(packed, _arena_views(packed), strict=True)
                               for seg in pb.segments
                               if in_place is None or seg.param in in_place
                               or seg.param not in whole])
        forms: dict[Form, None] = {}
        for pairs in copies:
            # grouped as ``foreach_copy`` groups one call's pairs for the kernel
            for gd, gs in kernel_groups([d for d, _ in pairs], [s for _, s in pairs]):
                d0, s0 = gd[0], gs[0]
                if len(gd) < MIN_PIECES or s0.shape != d0.shape:
                    continue
                # meta tensors sit at address 0: their byte offsets are their alignment
                align = address_align([int(t.storage_offset()) * t.element_size()
                                       for t in (*gd, *gs)])
                forms[Form(s0.dtype, d0.dtype, tuple(d0.shape), s0.stride(), d0.stride(),
                           align)] = None
        return list(forms)

    def _packing(self, bucket: Bucket) -> BucketPacking:
        got = self._packings.get(bucket.index)
        if got is None:
            got = plan_bucket(self.ctx.plan, bucket, self.ctx.rank)
            self._packings[bucket.index] = got
        return got

    def _whole_segments(self, index: int, pk: BucketPacking) -> dict[int, tuple[int, Any]]:
        """The bucket's parameters that arrive as one whole segment of one packed message
        (``_whole``), found once per bucket."""
        got = self._whole.get(index)
        if got is None:
            count: dict[int, int] = {}
            for pb in pk.peers:
                for seg in pb.segments:
                    count[seg.param] = count.get(seg.param, 0) + 1
            got = self._whole[index] = {
                seg.param: (k, seg) for k, pb in enumerate(pk.peers) if pb.direct is None
                for seg in pb.segments if seg.whole and count[seg.param] == 1}
        return got

    def _local(self, i: int, t: Any, shape: tuple[int, ...], where: str) -> tuple[Any, bool]:
        """``t`` as a contiguous tensor on our device, in its own dtype (a cast to the wire
        dtype happens in the packing copy); second value: True when that needed a copy
        (device move or contiguity; the engine hands in neither)."""
        spec = self.ctx.plan.params[i].spec
        if tuple(t.shape) != shape:
            raise PlanError(f"parameter {spec.name!r}: local shape {tuple(t.shape)} but the "
                            f"plan says {shape} at {where}")
        if t.device == self.device and t.is_contiguous():
            return t, False
        return t.to(device=self.device, non_blocking=True).contiguous(), True

    async def stage(self, bucket: Bucket, *,
                    sources: Mapping[str, torch.Tensor] | None = None,
                    sinks: Mapping[str, SinkLike] | None = None) -> Staging:
        """See ``Transport.stage`` (module docstring: zero-copy, arena, casts).

        Cancellation: nothing was submitted; the staging is dropped with the round.
        """
        self.check_usable()
        torch = _torch()
        streams = self.streams
        assert streams is not None
        pk = self._packing(bucket)
        where = self.ctx.where(bucket=bucket.index)
        plan = self.ctx.plan
        st = NcclStaging(bucket, packing=pk, nbytes_moved=pk.nbytes)
        producer = streams.producer()
        if pk.sending:
            if sources is None:
                raise LocalProtocolError(f"nccl: trainer stage without sources at {where}")
            streams.wait(streams.pack, producer)
            with streams.on(streams.pack):
                local: dict[int, Any] = {}
                wire: dict[int, Any] = {}
                cast: set[int] = set()
                for i in pk.params:
                    spec = plan.params[i].spec
                    t = lookup_tensor(sources, spec.name, where)
                    # The pack kernels below only read ``t`` once they run: keep it alive until
                    # the bucket is done, or a lazy source (freed when the pipeline drops the
                    # bucket's mapping) could be reused by the producer's next cast first.
                    st.keep.append(t)
                    shape = tuple(spec.layout.shard_shape(tuple(spec.shape)))
                    buf, copied = self._local(i, t, shape, where)
                    if copied:
                        st.keep.append(buf)
                        st.nbytes += buf.numel() * buf.element_size()
                    local[i] = buf
                    wire[i] = dtype = torch_dtype(spec.dtype)
                    if buf.dtype != dtype:  # the engine checked it is a float cast
                        cast.add(i)

                def zero_copy(pb: Any) -> bool:  # the wire bytes are the source's own
                    d = pb.direct
                    return d is not None and d.param not in cast

                need = sum(pb.nbytes for pb in pk.peers if not zero_copy(pb))
                arena = None
                if need:
                    arena = torch.empty(need, dtype=torch.uint8, device=self.device)
                    st.keep.append(arena)
                    st.nbytes += need
                dsts: list[Any] = []
                srcs: list[Any] = []
                temps: list[Any] = []  # casts at unaligned offsets: held and counted
                off = 0
                for pb in pk.peers:
                    d = pb.direct
                    if d is not None and d.span is not None and d.param not in cast:
                        a, b = d.span
                        st.wires.append((pb.peer, byte_view(local[d.param]).view(-1)[a:b]))
                        st.zero_copy += 1
                        continue
                    assert arena is not None
                    view = arena[off:off + pb.nbytes]
                    off += pb.nbytes
                    for seg in pb.segments:
                        dst, src = pack_pair(view, seg, local[seg.param], wire[seg.param],
                                             temps=temps)
                        dsts.append(dst)
                        srcs.append(src)
                        if seg.param in cast:
                            st.cast_bytes += seg.nbytes
                    st.wires.append((pb.peer, view))
                for tmp in temps:  # until release: the pack stream reads them, and they count
                    st.keep.append(tmp)
                    st.nbytes += tmp.numel() * tmp.element_size()
                if dsts:  # every peer's packed segments, casts included: one multi-tensor copy
                    foreach_copy(dsts, srcs)
            st.ready = streams.record(streams.pack)
            return st
        if sinks is None:
            raise LocalProtocolError(f"nccl: worker stage without sinks at {where}")
        records = self.sink_records(sinks)
        whole = self._whole_segments(bucket.index, pk)
        with streams.on(streams.pack):
            for i in pk.params:
                p = plan.params[i]
                spec = p.spec
                shape = tuple(p.dst.shard_shape(tuple(spec.shape)))
                sink = lookup_tensor(records, spec.name, where)
                dtype = torch_dtype(spec.dtype)
                target: Any = sink.target  # a tensor when in_place (checked first)
                if (sink.in_place and target.device == self.device and target.dtype == dtype
                        and target.is_contiguous() and tuple(target.shape) == shape):
                    st.dst_bytes[i] = byte_view(target)
                elif not sink.in_place and i in whole:  # the arena holds the whole shard
                    st.from_arena[i] = whole[i]
                else:
                    if sink.in_place and tuple(target.shape) != shape:
                        raise PlanError(f"parameter {spec.name!r}: target shape "
                                        f"{tuple(target.shape)} but the plan says {shape} at "
                                        f"{where}")
                    tmp = torch.empty(shape, dtype=dtype, device=self.device)
                    st.temps.append((i, tmp))
                    st.dst_bytes[i] = byte_view(tmp)
                    st.nbytes += tmp.numel() * tmp.element_size()
            packed_bytes = sum(pb.nbytes for pb in pk.peers if pb.direct is None)
            arena = None
            if packed_bytes:
                arena = torch.empty(packed_bytes, dtype=torch.uint8, device=self.device)
                st.keep.append(arena)
                st.nbytes += packed_bytes
            off = 0
            for k, pb in enumerate(pk.peers):
                d = pb.direct
                if d is not None and d.span is not None:
                    a, b = d.span
                    st.wires.append((pb.peer, st.dst_bytes[d.param].view(-1)[a:b]))
                    if not any(i == d.param for i, _ in st.temps):
                        st.zero_copy += 1
                    continue
                assert arena is not None
                view = arena[off:off + pb.nbytes]
                off += pb.nbytes
                st.wires.append((pb.peer, view))
                st.scatter.append(k)
        # Targets are written in place: the receive must follow any queued reader of them.
        st.ready = streams.record(producer)
        return st

    def transfer(self, staging: Staging) -> Completion:
        """One ``nccl.core.group()`` of the bucket's sends or receives on the native thread;
        the completion fires when the transfer stream passed them."""
        assert isinstance(staging, NcclStaging)
        st = staging
        nc, streams = self._nc, self.streams
        assert nc is not None and streams is not None
        sending = self.ctx.role == "trainer"
        where = self.ctx.where(round=self.round, bucket=st.bucket.index)

        def run() -> Any:
            comm, stream, sptr = self.begin_transfer(st.ready, where)
            peer = -1
            try:
                with nc.group():
                    for peer, buf in st.wires:
                        if sending:
                            comm.send(buf, peer, stream=sptr)
                        else:
                            comm.recv(buf, peer, stream=sptr)
            except Exception as exc:
                raise TransferError(
                    f"nccl: grouped {'send' if sending else 'recv'} failed at {where} "
                    f"(last peer rank {peer}): {type(exc).__name__}: {exc}",
                    rank=self.ctx.rank, round=self.round) from exc
            st.transferred = streams.record(stream)
            return st.transferred

        return self.submit(run, st, f"bucket {st.bucket.index} transfer")

    async def unpack(self, staging: Staging, sinks: Mapping[str, SinkLike]) -> None:
        """Worker: scatter arena segments (unpack stream, after the transfer event), copy
        temporary shards into their targets, then call load callbacks in plan order.

        Cancellation: targets may be partly written; the engine aborts and poisons.
        """
        if self.ctx.role == "trainer":
            return
        assert isinstance(staging, NcclStaging)
        st = staging
        pk = st.packing
        streams = self.streams
        assert pk is not None and streams is not None
        plan = self.ctx.plan
        records = self.sink_records(sinks)
        callbacks: list[tuple[str, Any, Any]] = []
        streams.wait(streams.unpack, st.transferred)
        with streams.on(streams.unpack):
            wires = dict(st.wires)
            dsts: list[Any] = []
            srcs: list[Any] = []
            for k in st.scatter:
                pb = pk.peers[k]
                buf = wires[pb.peer]
                for seg in pb.segments:
                    if seg.param in st.from_arena:
                        continue
                    dst, src = unpack_pair(buf, seg, st.dst_bytes[seg.param])
                    dsts.append(dst)
                    srcs.append(src)
            if dsts:  # every peer's segments of the bucket: one multi-tensor copy
                foreach_copy(dsts, srcs)
            into: list[Any] = []
            temps: list[Any] = []
            handed: dict[int, tuple[str, Any, Any]] = {}
            for i, (k, seg) in st.from_arena.items():
                spec = plan.params[i].spec
                raw = wires[pk.peers[k].peer][seg.offset:seg.offset + seg.nbytes]
                dtype = torch_dtype(spec.dtype)
                shape = tuple(plan.params[i].dst.shard_shape(tuple(spec.shape)))
                if raw.data_ptr() % spec.itemsize:  # unaligned in the arena: a copy
                    raw = raw.clone()
                handed[i] = (spec.name, records[spec.name].target, raw.view(dtype).view(shape))
            for i, tmp in st.temps:
                name = plan.params[i].spec.name
                sink = records[name]
                if sink.in_place:
                    into.append(sink.target)
                    temps.append(tmp)
                else:
                    handed[i] = (name, sink.target, tmp)
            callbacks = [handed[i] for i in pk.params if i in handed]  # plan order
            if into:  # targets that cannot take bytes (strided, another device): one more
                foreach_copy(into, temps, non_blocking=True)
        await self.finish_unpack(st, bool(st.scatter or st.temps or st.from_arena), callbacks)

    def release(self, staging: Staging) -> None:
        if isinstance(staging, NcclStaging):
            staging.wires = []
            staging.keep = []
            staging.temps = []
            staging.dst_bytes = {}
            staging.from_arena = {}
            staging.ready = staging.transferred = None
