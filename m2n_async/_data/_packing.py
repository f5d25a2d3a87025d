"""The packing planner: per bucket and per peer, where each piece lies in the packed buffer.

Theory of operation. The plan lists, for every parameter, the pieces (global boxes) each
source rank sends to each destination rank, sorted by ``(src_rank, dst_rank, box)``. Within a
bucket, a rank moves ONE contiguous byte buffer per peer: the concatenation of its pieces for
that peer in (parameter, piece) order. Sender and receiver walk the same parameters and the
same sorted pieces, filtered to their pair, so both compute the same segment offsets from the
plan alone — nothing about the layout travels, and one send matches one receive of the same
size.

Everything is done in *bytes*: a local shard is viewed as ``uint8`` with its last dim scaled
by the item size (``tensor.view(torch.uint8)``), so packing never needs the buffer offset
aligned to the dtype, works for every fixed-width dtype (bool, int16 and fp8 included) and is
bit-exact by construction (a copy of bytes, never a cast).

Messages: a peer buffer moves as one or more *messages* (one send matching one receive). A
piece of at least ``DIRECT_MIN_BYTES`` is a message of its own; runs of smaller pieces are
packed together into one message (per-message overhead dominates tiny tensors). With
``split_runs`` (the Gloo transport), a large piece that is strided on either side but made of
runs of at least ``DIRECT_MIN_BYTES`` contiguous on both sides is cut into one segment per
run first, so it moves zero-copy run by run instead of through a pack and an unpack. The split
depends only on piece sizes, so both sides make the same one. A message of one piece that is a
contiguous byte range of this side's local shard moves zero-copy — straight from the trainer's
shard or straight into the worker's target — and needs no staging; each side decides that
alone (the wire bytes are the same either way), so a row-sharded source feeding a
column-sharded destination packs on the trainer and lands in place on the worker.

Casts. A trainer may hand in a source whose dtype differs from the wire dtype when the
conversion is a plain float cast (fp32 master weights, bf16 on the wire:
``_proto.plan.cast_problem``). Such a segment is copied *typed*: the destination is its
region of the packed buffer viewed in the wire dtype, the source the same region of the
shard in elements, and the copy that packs does the cast (``Tensor.copy_`` rounds as
``Tensor.to``: to nearest, ties to even). No cast copy of the shard is made first, and a cast
source never moves zero-copy (its bytes are not the wire's). A region that does not start at
a multiple of the wire item size in the buffer (a message mixing dtypes of different sizes)
cannot be viewed typed; it is cast into a temporary of its own size and copied as bytes. That
temporary is memory the bucket holds: the staging keeps it until release and counts it in
``Staging.nbytes``, so the reported peak is what was really held (torch cannot cast straight
into an unaligned region: ``view(dtype)`` refuses it, and a typed store there is a misaligned
access, which CUDA faults on).

Executors copy many segments with ONE multi-tensor call (``torch._foreach_copy_``, chunked by
``FOREACH_CHUNK``): per-segment ``copy_`` calls cost a dispatcher round trip each, which
dominates many small tensors (GPU: 1024 fp32 → bf16 copies 9.5 ms one by one, 0.5 ms as one
``_foreach_copy_``). The casting copies go in the same call.

This module is the planner (pure Python over the plan, cached per rank and bucket) plus the
CPU/torch executors that copy segments; the GPU ``nccl`` transport reuses both (its copies
then run on a CUDA stream).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from m2n_async._data._kernels import MIN_PIECES, copy_many
from m2n_async._data._kernels import available as kernels_available
from m2n_async._proto.errors import PlanError

if TYPE_CHECKING:
    from m2n_async._proto.layout import Box
    from m2n_async._proto.plan import Bucket, TransferPlan

__all__ = [
    "DIRECT_MIN_BYTES",
    "FOREACH_CHUNK",
    "BucketPacking",
    "Message",
    "PeerBuffer",
    "ScatterPlan",
    "Segment",
    "byte_view",
    "copy_in",
    "copy_out",
    "element_region",
    "flat_bytes",
    "foreach_copy",
    "kernel_groups",
    "pack_pair",
    "pack_peer",
    "pack_segments",
    "plan_bucket",
    "scatter",
    "scatter_plan",
    "split_messages",
    "unpack_pair",
    "unpack_peer",
    "unpack_segments",
]


class Segment(NamedTuple):
    """One piece inside a peer buffer, and where it lies in the rank's local shard."""

    param: int                       # index in the plan
    offset: int                      # byte offset in the peer buffer
    nbytes: int
    slices: tuple[slice, ...]        # into the local shard's byte view (see ``byte_view``)
    shape: tuple[int, ...]           # byte-view shape of the region (``slices`` extents)
    span: tuple[int, int] | None     # [start, stop) in the flat byte view, if contiguous
    whole: bool                      # the segment is the entire local shard


#: Pieces at least this large travel as their own message (zero-copy where contiguous).
#: Part of the wire contract: the Gloo transport reports it in its data-plane identity.
#: Measured on the CPU bench (2+2 ranks, 350 MB demo model, aligned layouts): with 256 KiB
#: the extra Gloo messages cost more than packing saves (0.65x raw); 1 MiB gives 0.92x.
DIRECT_MIN_BYTES = 1024 * 1024


class Message(NamedTuple):
    """One send/receive: consecutive segments of a peer buffer (offsets are in the buffer)."""

    offset: int
    nbytes: int
    segments: tuple[Segment, ...]

    @property
    def direct(self) -> Segment | None:
        """The single contiguous segment if this side can move the message zero-copy."""
        if len(self.segments) == 1 and self.segments[0].span is not None:
            return self.segments[0]
        return None


class PeerBuffer(NamedTuple):
    """Everything this rank moves to/from one peer within one bucket, in wire order."""

    peer: int
    nbytes: int
    segments: tuple[Segment, ...]
    messages: tuple[Message, ...]

    @property
    def direct(self) -> Segment | None:
        """The single contiguous segment if the whole buffer can move zero-copy, else None."""
        if len(self.segments) == 1 and self.segments[0].span is not None:
            return self.segments[0]
        return None


def split_messages(segments: tuple[Segment, ...], direct_min: int) -> tuple[Message, ...]:
    """Group a peer buffer's segments into messages (module docstring); sizes only."""
    out: list[Message] = []
    run: list[Segment] = []

    def flush() -> None:
        if run:
            start = run[0].offset
            out.append(Message(start, run[-1].offset + run[-1].nbytes - start, tuple(run)))
            run.clear()

    for seg in segments:
        if seg.nbytes >= direct_min:
            flush()
            out.append(Message(seg.offset, seg.nbytes, (seg,)))
        else:
            run.append(seg)
    flush()
    return tuple(out)


class BucketPacking(NamedTuple):
    """A rank's side of one bucket: its peer buffers (ascending peer rank) and totals."""

    bucket: Bucket
    rank: int
    sending: bool                     # True on a trainer (source), False on a worker
    peers: tuple[PeerBuffer, ...]
    nbytes: int                       # payload bytes this rank moves in the bucket
    params: tuple[int, ...]           # params with at least one segment here, in plan order


def _local_geometry(plan: TransferPlan, i: int, rank: int, sending: bool
                    ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(local shape, local box origin, itemsize) of param ``i`` on ``rank``'s side."""
    p = plan.params[i]
    spec = p.spec
    layout = spec.layout if sending else p.dst
    shape = tuple(spec.shape)
    box = layout.box(shape, rank)
    local = tuple(hi - lo for lo, hi in box)
    origin = tuple(lo for lo, _ in box)
    return local, origin, spec.itemsize


def _segment(param: int, offset: int, nbytes: int, box: Box, local: tuple[int, ...],
             origin: tuple[int, ...], itemsize: int) -> Segment:
    if not local:  # a 0-d tensor is moved as its single element
        return Segment(param, offset, nbytes, (slice(0, itemsize),), (itemsize,),
                       (0, itemsize), True)
    rel = [(lo - o, hi - o) for (lo, hi), o in zip(box, origin, strict=True)]
    # byte view: the last dim is scaled by the item size
    bshape = (*local[:-1], local[-1] * itemsize)
    lo_last, hi_last = rel[-1]
    rel[-1] = (lo_last * itemsize, hi_last * itemsize)
    slices = tuple(slice(lo, hi) for lo, hi in rel)
    shape = tuple(hi - lo for lo, hi in rel)
    # Contiguous iff every dim after the last partial one is full and every dim before it
    # has extent 1 (row-major).
    partial = [d for d in range(len(bshape)) if shape[d] != bshape[d]]
    span: tuple[int, int] | None = None
    if not partial or all(shape[d] == 1 for d in range(partial[-1])):
        start = 0
        for d in range(len(bshape)):
            start = start * bshape[d] + rel[d][0]
        span = (start, start + nbytes)
    whole = not partial
    return Segment(param, offset, nbytes, slices, shape, span, whole)


def _split_dim(extent: tuple[int, ...], local: tuple[int, ...]) -> int:
    """How many leading dims of a box with ``extent`` must be taken one index at a time for
    each resulting sub-box to be contiguous in a local shard of shape ``local`` (0: the box
    is contiguous already)."""
    partial = [d for d in range(len(local)) if extent[d] != local[d]]
    if not partial or all(extent[d] == 1 for d in range(partial[-1])):
        return 0
    return partial[-1]


def _runs(box: Box, src_local: tuple[int, ...], dst_local: tuple[int, ...], itemsize: int,
          direct_min: int) -> list[Box] | None:
    """The piece ``box`` cut into sub-boxes, in row-major order, that are contiguous in BOTH
    the source's and the destination's local shards, when every such run is at least
    ``direct_min`` bytes and there is more than one; else None (the piece stays whole).

    The sub-boxes concatenate to the piece's bytes in the same row-major order, so the wire
    bytes are unchanged; only the message boundaries move. Both sides compute it from the
    plan alone (both local shapes are known to everybody), so they agree.
    """
    if not box:
        return None
    extent = tuple(hi - lo for lo, hi in box)
    k = max(_split_dim(extent, src_local), _split_dim(extent, dst_local))
    if k == 0:
        return None
    count = 1
    for n in extent[:k]:
        count *= n
    run = itemsize
    for n in extent[k:]:
        run *= n
    if count <= 1 or run < direct_min:
        return None
    tail = tuple(box[k:])
    return [tuple((i, i + 1) for i in idx) + tail
            for idx in itertools.product(*(range(lo, hi) for lo, hi in box[:k]))]


def plan_bucket(plan: TransferPlan, bucket: Bucket, rank: int, *,
                direct_min: int = DIRECT_MIN_BYTES, split_runs: bool = False
                ) -> BucketPacking:
    """Compute ``rank``'s peer buffers for ``bucket`` (pure; cache the result per bucket).

    ``direct_min`` and ``split_runs`` must be the same on every rank (they decide message
    boundaries). ``split_runs``: a piece that is strided on either side but made of runs of
    at least ``direct_min`` bytes contiguous on both sides (e.g. an expert tensor sharded on
    dim 0 on one mesh and dim 1 on the other) becomes one segment per run, so each run moves
    zero-copy as its own message instead of being packed and unpacked."""
    sending = rank < plan.trainer_ranks
    per_peer: dict[int, list[Segment]] = {}
    offsets: dict[int, int] = {}
    params: list[int] = []
    received: dict[int, int] = {}
    mine = plan.pieces_from if sending else plan.pieces_to  # O(1) per param, cached
    for i in range(bucket.start, bucket.stop):
        geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
        locals_: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        touched = False
        for piece in mine(i, rank):
            peer = piece.dst_rank if sending else piece.src_rank
            if geometry is None:
                geometry = _local_geometry(plan, i, rank, sending)
                if split_runs:
                    p = plan.params[i]
                    shape = tuple(p.spec.shape)
                    locals_ = (p.spec.layout.shard_shape(shape), p.dst.shard_shape(shape))
            off = offsets.get(peer, 0)
            segs = per_peer.setdefault(peer, [])
            runs = (_runs(piece.box, *locals_, geometry[2], direct_min)
                    if split_runs and piece.nbytes >= 2 * direct_min else None)
            if runs is None:
                segs.append(_segment(i, off, piece.nbytes, piece.box, *geometry))
            else:
                run_bytes = piece.nbytes // len(runs)
                for j, sub in enumerate(runs):
                    segs.append(_segment(i, off + j * run_bytes, run_bytes, sub, *geometry))
            offsets[peer] = off + piece.nbytes
            touched = True
            if not sending:
                received[i] = received.get(i, 0) + piece.nbytes
        if touched:
            params.append(i)
        if not sending and geometry is not None:
            # The plan promises every destination rank's box is covered exactly once.
            local, _, itemsize = geometry
            want = itemsize
            for n in local:
                want *= n
            if received[i] != want:
                raise PlanError(f"parameter {plan.params[i].spec.name!r}: the plan delivers "
                                f"{received[i]} bytes to rank {rank}, its shard has {want}")
    peers = tuple(PeerBuffer(peer, offsets[peer], tuple(per_peer[peer]),
                             split_messages(tuple(per_peer[peer]), direct_min))
                  for peer in sorted(per_peer))
    return BucketPacking(bucket, rank, sending, peers, sum(offsets.values()), tuple(params))


# -- executors (torch; CPU here, the same calls on a CUDA stream in the GPU transports) ------


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 with its last dim scaled by the item size (no copy; needs contiguous)."""
    if t.dim() == 0:
        t = t.reshape(1)
    elif t.stride(-1) != 1 and t.is_contiguous():
        # A size-1 dim may carry any stride in a contiguous tensor (a transposed (1, n) is
        # (n, 1) with strides (1, n)), and view(uint8) refuses a last stride that is not 1:
        # the canonical strides of a contiguous tensor alias the same bytes (reshape and view
        # keep the odd stride). Guarded: for a tensor that is not contiguous they would not.
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.append(step)
            step *= n
        t = t.as_strided(t.shape, strides[::-1])
    return t.view(torch.uint8)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as one flat uint8 view (no copy)."""
    if t.dim() != 1:  # one dispatcher call saved per tensor on the common 1-D case
        t = t.reshape(-1)
    return t.view(torch.uint8)


def copy_in(buf: torch.Tensor, seg: Segment, src_bytes: torch.Tensor, base: int = 0) -> None:
    """Copy ``seg``'s region of a local shard (byte view) into the flat ``buf``, which holds
    the bytes from buffer offset ``base`` on."""
    a = seg.offset - base
    buf[a:a + seg.nbytes].view(seg.shape).copy_(src_bytes[seg.slices])


def copy_out(buf: torch.Tensor, seg: Segment, dst_bytes: torch.Tensor, base: int = 0) -> None:
    """Copy ``seg`` from the flat ``buf`` (starting at buffer offset ``base``) into its region
    of a local shard (byte view)."""
    a = seg.offset - base
    dst_bytes[seg.slices].copy_(buf[a:a + seg.nbytes].view(seg.shape))


#: Segments per ``torch._foreach_copy_`` call. A CPU caller's Python between calls holds the
#: GIL and the call releases it, so chunks keep the event loop from waiting for the GIL
#: behind thousands of tiny parameters; on a GPU stream a chunk is one launch batch.
FOREACH_CHUNK = 512


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *,
                 chunk: int = FOREACH_CHUNK, non_blocking: bool = False) -> None:
    """``dsts[k].copy_(srcs[k])`` for every k, as few multi-tensor calls as ``chunk`` allows
    (a cast where the dtypes differ, exactly as ``copy_``).

    On CUDA, each group of at least ``MIN_PIECES`` pairs of one geometry (shape, strides,
    dtypes) goes through one Triton launch where Triton is installed (``_kernels``: strided
    segments are one copy each under ``_foreach_copy_``, 1024 column blocks 8.3 ms vs
    0.07 ms on an H200). The rest is grouped by (destination, source) dtype: the fused
    multi-tensor kernel takes lists of one dtype pair and falls back to one copy per tensor
    otherwise (on the CPU every pair is its own copy anyway, so the order is kept).
    """
    if dsts and dsts[0].is_cuda and len(dsts) >= MIN_PIECES and kernels_available():
        dsts, srcs = _copy_by_kernel(dsts, srcs)
        if not dsts:
            return
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0], non_blocking=non_blocking)
        return
    if dsts and dsts[0].is_cuda:
        groups: dict[tuple[torch.dtype, torch.dtype],
                     tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for d, s in zip(dsts, srcs, strict=True):
            g = groups.setdefault((d.dtype, s.dtype), ([], []))
            g[0].append(d)
            g[1].append(s)
        if len(groups) > 1:
            for gd, gs in groups.values():
                foreach_copy(gd, gs, chunk=chunk, non_blocking=non_blocking)
            return
    for c in range(0, len(dsts), chunk):
        torch._foreach_copy_(dsts[c:c + chunk], srcs[c:c + chunk], non_blocking=non_blocking)


def kernel_groups(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]
                  ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The (dsts, srcs) pairs grouped by dtypes, geometry and devices: each group one launch
    of the Triton copy (``_copy_by_kernel``; ``NcclTransport._copy_forms`` foresees them)."""
    groups: dict[tuple[object, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs, strict=True):
        # get_device(): -1 on the CPU; a target on another device must not share a group
        key = (d.dtype, s.dtype, d.shape, d.stride(), s.stride(), d.get_device(),
               s.get_device())
        g = groups.setdefault(key, ([], []))
        g[0].append(d)
        g[1].append(s)
    return list(groups.values())


def _copy_by_kernel(dsts: list[torch.Tensor], srcs: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy every group of one geometry the Triton kernel takes; return the pairs left."""
    rest_d: list[torch.Tensor] = []
    rest_s: list[torch.Tensor] = []
    for gd, gs in kernel_groups(dsts, srcs):
        # a group shares dtypes, geometry and devices by its key: only its first pair is checked
        if not copy_many(gd, gs, uniform=True):
            rest_d += gd
            rest_s += gs
    return rest_d, rest_s


def element_region(seg: Segment, itemsize: int
                   ) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """``seg``'s region of the local shard in elements: (slices, shape). ``Segment.slices``
    and ``.shape`` are in bytes (last dim scaled by the item size); a 0-d shard is (1,)."""
    *head, last = seg.slices
    *hshape, n = seg.shape
    return ((*head, slice(last.start // itemsize, last.stop // itemsize)),
            (*hshape, n // itemsize))


def _typed_region(src: torch.Tensor, seg: Segment, itemsize: int) -> torch.Tensor:
    """``seg``'s region of the typed local shard ``src`` (any dtype), as a view."""
    if src.dim() == 0:
        return src.reshape(1)
    if seg.whole:
        return src
    if seg.span is not None:
        a, b = seg.span
        return src.reshape(-1)[a // itemsize:b // itemsize]
    return src[element_region(seg, itemsize)[0]]


def pack_pair(buf: torch.Tensor, seg: Segment, src: torch.Tensor, wire: torch.dtype,
              base: int = 0, *, temps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination in ``buf``, source) of one segment for a multi-tensor copy.

    ``buf`` is flat uint8 holding buffer offsets ``base`` on; ``src`` the param's local shard
    (contiguous). Same dtype as the wire: both sides as bytes (bit-exact for every dtype).
    Another dtype (a float cast, checked by the caller): both typed, so the copy casts; when
    the destination is not aligned to the wire item size, the cast goes through a temporary
    of the segment's size, appended to ``temps``, and the pair is bytes again (module
    docstring): the caller's staging holds and counts what ``temps`` gets.
    """
    a = seg.offset - base
    piece = buf[a:a + seg.nbytes]
    if src.dtype == wire:
        sb = byte_view(src)
        if seg.span is not None:
            lo, hi = seg.span
            return piece, (sb.view(-1) if seg.whole else sb.view(-1)[lo:hi])
        return piece.view(seg.shape), sb[seg.slices]
    itemsize = wire.itemsize
    region = _typed_region(src, seg, itemsize)
    if piece.storage_offset() % itemsize == 0 and piece.data_ptr() % itemsize == 0:
        typed = piece.view(wire)
        return (typed if seg.span is not None and not seg.whole
                else typed.view(region.shape)), region
    cast = region.to(wire).contiguous()  # unaligned: a temporary of this segment's size
    temps.append(cast)
    return piece, byte_view(cast).view(-1)  # its bytes in row-major order: the wire order


def unpack_pair(buf: torch.Tensor, seg: Segment, dst_bytes: torch.Tensor, base: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(region of the destination byte view ``dst_bytes``, its bytes in ``buf``) of one
    segment, for a multi-tensor copy (the mirror of ``pack_pair``; no casts on this side)."""
    a = seg.offset - base
    piece = buf[a:a + seg.nbytes]
    if seg.span is not None:
        lo, hi = seg.span
        flat = dst_bytes.view(-1)
        return (flat if seg.whole else flat[lo:hi]), piece
    return dst_bytes[seg.slices], piece.view(seg.shape)


def pack_segments(buf: torch.Tensor, segs: tuple[Segment, ...],
                  src_bytes: Callable[[int], torch.Tensor], base: int = 0,
                  src_flat: Callable[[int], torch.Tensor] | None = None) -> None:
    """Fill ``buf`` (flat uint8 holding offsets ``base`` on) with ``segs``.

    ``src_bytes(i)`` returns the byte view of param ``i``'s local shard (``byte_view``),
    ``src_flat(i)`` its flat byte view (``flat_bytes``). When every segment is a contiguous
    range, one ``torch.cat(out=...)`` does the whole buffer; otherwise one multi-tensor copy
    (per-segment Python and dispatch overhead dominates packing of many small tensors).
    """
    if len(segs) > 1 and all(s.span is not None for s in segs):
        flat = src_flat or (lambda i: src_bytes(i).view(-1))
        parts = []
        for s in segs:
            if s.whole:
                parts.append(flat(s.param))
            else:
                a, b = s.span  # type: ignore[misc]
                parts.append(flat(s.param)[a:b])
        first = segs[0].offset - base
        last = segs[-1].offset + segs[-1].nbytes - base
        torch.cat(parts, out=buf[first:last])
        return
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for s in segs:
        a = s.offset - base
        dsts.append(buf[a:a + s.nbytes].view(s.shape))
        srcs.append(src_bytes(s.param)[s.slices])
    if dsts:
        foreach_copy(dsts, srcs)


def pack_peer(buf: torch.Tensor, peer: PeerBuffer,
              src_bytes: Callable[[int], torch.Tensor]) -> None:
    """Fill ``buf`` (flat uint8, ``peer.nbytes`` long) with all of ``peer``'s segments."""
    pack_segments(buf, peer.segments, src_bytes)


def unpack_segments(buf: torch.Tensor, segs: tuple[Segment, ...],
                    dst_bytes: Mapping[int, torch.Tensor], base: int = 0) -> None:
    """Scatter ``segs`` from ``buf`` (holding offsets ``base`` on) into the byte views
    ``dst_bytes[param]`` (params absent from the mapping are skipped: the caller handles
    them), with one multi-tensor copy."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for s in segs:
        dst = dst_bytes.get(s.param)
        if dst is not None:
            a = s.offset - base
            dsts.append(dst[s.slices])
            srcs.append(buf[a:a + s.nbytes].view(s.shape))
    if dsts:
        foreach_copy(dsts, srcs)


class ScatterPlan(NamedTuple):
    """A message whose segments are all contiguous in their destinations, ready to scatter
    with one ``torch._foreach_copy_`` (destination views built once, reused every round)."""

    sizes: tuple[int, ...]
    targets: tuple[torch.Tensor, ...]


def scatter_plan(segs: tuple[Segment, ...],
                 dst_flat: Mapping[int, torch.Tensor]) -> ScatterPlan | None:
    """The ``ScatterPlan`` of a message into flat destination views, or None when a segment
    is not contiguous or its param has no view (a load callback)."""
    sizes: list[int] = []
    targets: list[torch.Tensor] = []
    for s in segs:
        flat = dst_flat.get(s.param)
        if flat is None or s.span is None:
            return None
        a, b = s.span
        sizes.append(s.nbytes)
        targets.append(flat if s.whole else flat[a:b])
    return ScatterPlan(tuple(sizes), tuple(targets))


def scatter(buf: torch.Tensor, plan: ScatterPlan) -> None:
    """Copy the message in ``buf`` to its destinations in one call."""
    parts = torch.split(buf, list(plan.sizes))
    torch._foreach_copy_(list(plan.targets), list(parts))


def unpack_peer(buf: torch.Tensor, peer: PeerBuffer,
                dst_bytes: Mapping[int, torch.Tensor]) -> None:
    """Scatter all of ``peer``'s segments from ``buf`` (``peer.nbytes`` long)."""
    unpack_segments(buf, peer.segments, dst_bytes)
