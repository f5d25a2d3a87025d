"""The transfer plan: validation, digests, geometry, buckets and a cost bound.

Theory of operation: a ``TransferPlan`` is the ordered list of ``ParamTransfer`` every rank
agrees on in the handshake. Everything else every rank must agree on — which source rank sends
which box to which destination rank, bucket boundaries, fan-in/fan-out — is a pure function of
the plan, so each rank computes it locally and identically; nothing of it travels.

Geometry. A layout cuts a tensor into equal slabs along one dim, so the overlap of a source
shard and a destination shard is a box (empty or not). For each destination *rank* (every
replica of a destination shard needs the whole shard) we list the overlaps with the source
shards — together they cover its box exactly once. A source shard held by ``R`` replicas must
pick which replica sends what: we "water-fill" the shard's overlaps, in order, into the
replicas with a quota of ``max(ceil(bytes / R), MIN_PIECE_BYTES)`` each, cutting an overlap
along its largest dim where a quota ends (the targets are cumulative, so rounding never piles
up on the last replica). Each replica then sends within ``max(one slice, 2 * MIN_PIECE_BYTES)``
of the quota, a shard needs at most ``R - 1`` extra cuts, and no cut leaves a piece below
``MIN_PIECE_BYTES``. The floors stop small tensors being sliced into many tiny pieces
(per-piece pack cost dominates there); to keep those from all landing on the first replica,
the replica order is rotated by the parameter's index in the plan (``i mod R``), which also
spreads consecutive parameters of one bucket across replicas. ``pieces(i)`` is sorted by
``(src_rank, dst_rank, box)``: a sender packs, and a receiver unpacks, the pieces of one peer
in that order, so both sides agree on every byte offset without exchanging any.

Cost. Geometry depends only on ``(shape, dtype, source layout, destination layout)``; real
models have a few hundred distinct such keys among 10^5 tensors, so it is computed lazily once
per key and shared (the rotation is applied as a cheap relabelling). Per-rank byte totals are
summed per key, not per parameter.

Buckets. A bucket is a contiguous run of parameters. A parameter's bucket cost is the largest
number of bytes any one rank sends or receives for it (rotation-invariant), and a bucket holds
parameters while the sum of costs fits ``bucket_bytes``; the sum bounds every rank's staging
for the bucket in both directions. A parameter costlier than ``bucket_bytes`` gets a bucket of
its own. The bound is conservative only when different parameters of one bucket load
different ranks, which layouts covering the whole mesh rarely do.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple, Protocol

import msgspec

from m2n_async._proto.errors import PlanError
from m2n_async._proto.lanes import check_lane
from m2n_async._proto.layout import REPLICATE, Box, Layout, show_placements
from m2n_async._proto.messages import (
    PLAN_SCHEMA_VERSION,
    PROTO_VERSION,
    PlanRecord,
    SourcePlanRecord,
)
from m2n_async._proto.params import (
    DTYPE_ITEMSIZE,
    M2N_DTYPES,
    ParamSpec,
    ParamTransfer,
    dtype_name,
)

__all__ = [
    "M2N_MAX_CALL_BYTES",
    "MAX_BUCKET_PARAMS",
    "M2N_MAX_FAN_IN",
    "M2N_MAX_FAN_OUT",
    "MIN_PIECE_BYTES",
    "Bucket",
    "ParamTransfer",
    "Piece",
    "CAST_DTYPES",
    "TransferPlan",
    "carry_problem",
    "cast_problem",
    "check_plan_limits",
    "check_source_dtype",
    "split_buckets",
    "complete_plan_digest",
    "source_plan_digest",
    "validate_local_buffer",
    "validate_source_specs",
]

M2N_MAX_FAN_IN: Final[int] = 16
#: Most bytes one M2N reshard may pack on one rank with NCCL's default PACK staging (4 slots of
#: 2 GiB; REFERENCE §1): a bigger one fails at run time unless ``NCCL_RESHARD_PACK_BUFFSIZES``
#: is raised on every rank.
M2N_MAX_CALL_BYTES: Final[int] = 2 << 30
"""NCCL M2N: at most this many source shards may feed one destination shard."""
M2N_MAX_FAN_OUT: Final[int] = 64
"""NCCL M2N: at most this many destination shards may read one source shard."""
M2N_MAX_TENSOR_RANK: Final[int] = 3
MIN_PIECE_BYTES: Final[int] = 1 << 16
"""A replicated source shard is not cut into per-replica pieces smaller than this."""


class Piece(NamedTuple):
    """One box ``src_rank`` sends to ``dst_rank`` (global coordinates) and its size in bytes."""

    src_rank: int
    dst_rank: int
    box: Box
    nbytes: int


class Bucket(NamedTuple):
    """Parameters ``[start, stop)`` of the plan; ``nbytes`` bounds any rank's staging bytes."""

    # The contract names this field `index`; it shadows tuple.index, which nobody needs here.
    index: int  # type: ignore[assignment]
    start: int
    stop: int
    nbytes: int


#: A bucket holds at most this many parameters. Many tiny tensors (norms, biases, MoE
#: experts) fill a byte budget with 10^5 entries, and one such bucket would leave nothing to
#: overlap: the trainer packs all of it, then the worker unpacks all of it. Compared across
#: ranks in the handshake (it moves bucket boundaries).
MAX_BUCKET_PARAMS: Final[int] = 4096


def split_buckets(plan: TransferPlan, buckets: Sequence[Bucket], max_params: int
                  ) -> tuple[Bucket, ...]:
    """``buckets`` with every bucket of more than ``max_params`` parameters cut into runs of
    ``max_params``, renumbered; a pure function of the plan, so identical on every rank."""
    out: list[Bucket] = []
    for b in buckets:
        for start in range(b.start, b.stop, max_params):
            stop = min(start + max_params, b.stop)
            if (start, stop) == (b.start, b.stop):
                nbytes = b.nbytes
            else:
                nbytes = sum(plan.param_costs()[start:stop])
            out.append(Bucket(len(out), start, stop, nbytes))
    return tuple(out)


class _Need(NamedTuple):
    # One overlap some destination rank needs from one source shard.
    dst_rank: int
    box: Box
    nbytes: int


def _box_volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b, strict=True):
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


class _BoxIndex:
    """The shard boxes of one layout, indexed so that the boxes meeting a given box are found
    without testing every one: testing all pairs costs ``S * D`` intersections per geometry,
    ~1.5 s at 2048 x 1536 shards on a CPU core, while aligned layouts meet in ``~S + D`` pairs.

    Along each dim the distinct intervals of an even split are disjoint and sorted, so the
    ones meeting ``[lo, hi)`` are one run, found by bisection; the boxes on the dim whose run
    holds the fewest are the candidates, tested in full by the caller. Boxes whose intervals
    along some dim overlap without being equal (no layout here makes them) are not indexed:
    every box is a candidate then. Candidates come in ascending box order, as the all-pairs
    loop would take them (the water-fill depends on that order)."""

    __slots__ = ("_dims", "_n")

    def __init__(self, boxes: Sequence[Box]) -> None:
        self._n = len(boxes)
        #: per dim: the distinct intervals' starts and ends, sorted, and for each run of
        #: them, through prefix counts, how many boxes it holds; None: not indexed
        self._dims: list[tuple[list[int], list[int], list[list[int]], list[int]]] | None = []
        ndim = len(boxes[0]) if boxes else 0
        for d in range(ndim):
            groups: dict[tuple[int, int], list[int]] = {}
            for j, box in enumerate(boxes):
                groups.setdefault(box[d], []).append(j)
            ivs = sorted(groups)
            if any(ivs[i][1] > ivs[i + 1][0] for i in range(len(ivs) - 1)):
                self._dims = None
                return
            members = [groups[iv] for iv in ivs]
            counts = [0]
            for m in members:
                counts.append(counts[-1] + len(m))
            self._dims.append(([lo for lo, _ in ivs], [hi for _, hi in ivs], members, counts))

    def meeting(self, box: Box) -> Sequence[int]:
        """The indices of the boxes that may meet ``box``, ascending (a superset)."""
        if not self._dims:
            return range(self._n)
        best: tuple[int, int, int, int] | None = None
        for d, (starts, ends, _, counts) in enumerate(self._dims):
            lo, hi = box[d]
            a = bisect_left(ends, lo + 1)  # the first interval ending after lo
            b = bisect_left(starts, hi)  # the intervals from b on start at or after hi
            if a >= b:
                return ()
            if best is None or counts[b] - counts[a] < best[0]:
                best = (counts[b] - counts[a], d, a, b)
        assert best is not None
        _, d, a, b = best
        members = self._dims[d][2]
        if b - a == 1:
            return members[a]  # one interval: its boxes, ascending as grouped
        return sorted(j for i in range(a, b) for j in members[i])


def _waterfill(needs: list[_Need], replicas: int) -> list[tuple[int, _Need]]:
    """Assign the needs of one source shard to replica slots ``0..replicas-1``.

    Returns ``(slot, need)`` pairs in need order; a need may be cut along its largest dim
    across consecutive slots. Slot ``q`` is filled until the bytes assigned so far reach
    ``(q + 1) * quota`` (to the nearest slice), so rounding never accumulates: every slot's
    load is within ``max(one slice, 2 * MIN_PIECE_BYTES)`` of the quota, and no cut leaves a
    part below ``MIN_PIECE_BYTES``.
    """
    if replicas == 1:
        return [(0, n) for n in needs]
    total = sum(n.nbytes for n in needs)
    quota = max(-(-total // replicas), MIN_PIECE_BYTES)
    last = replicas - 1
    out: list[tuple[int, _Need]] = []
    slot, room = 0, quota  # room: bytes left before slot's cumulative target (may go < 0)
    for need in needs:
        rest = need
        while True:
            # Small needs are never cut (the overfill is carried into the next slot's room).
            if rest.nbytes <= room or slot == last or rest.nbytes < 2 * MIN_PIECE_BYTES:
                out.append((slot, rest))
                room -= rest.nbytes
                if room <= 0 and slot < last:
                    slot, room = slot + 1, room + quota
                break
            # Cut `rest` along its largest dim so its head fills `room` to the nearest slice,
            # leaving neither part below MIN_PIECE_BYTES.
            box = rest.box
            dim = max(range(len(box)), key=lambda d: box[d][1] - box[d][0])
            lo, hi = box[dim]
            extent = hi - lo
            unit = rest.nbytes // extent  # bytes per slice along `dim`
            cut = (2 * room + unit) // (2 * unit) if room > 0 else 0  # round(room / unit)
            if cut * unit < MIN_PIECE_BYTES:
                cut = 0
            elif (extent - cut) * unit < MIN_PIECE_BYTES:
                cut = extent
            if cut >= extent:  # the whole rest belongs here
                out.append((slot, rest))
                room -= rest.nbytes
                slot, room = slot + 1, room + quota
                break
            if cut > 0:
                head = (*box[:dim], (lo, lo + cut), *box[dim + 1:])
                tail = (*box[:dim], (lo + cut, hi), *box[dim + 1:])
                out.append((slot, _Need(rest.dst_rank, head, cut * unit)))
                rest = _Need(rest.dst_rank, tail, rest.nbytes - cut * unit)
                room -= cut * unit
            slot, room = slot + 1, room + quota
    return out


class _Geometry:
    """Geometry of one ``(shape, dtype, src, dst)`` key, shared by every parameter with it."""

    __slots__ = ("_by_rank", "_rotated", "cost", "fan_in", "fan_out", "nrep", "recv", "replicas",
                 "send_slots", "slot_pieces")

    def __init__(self, shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout):
        s_shards, d_shards = src.num_shards, dst.num_shards
        s_boxes = [src.shard_box(shape, k) for k in range(s_shards)]
        d_boxes = [dst.shard_box(shape, k) for k in range(d_shards)]
        d_replicas = [dst.replicas(k) for k in range(d_shards)]
        self.replicas: list[tuple[int, ...]] = [src.replicas(k) for k in range(s_shards)]
        self.nrep = src.num_replicas  # every source shard has this many replicas
        fan_in = [0] * d_shards
        fan_out = [0] * s_shards
        # pieces per source shard as (slot, need); slot indexes the shard's replica tuple
        self.slot_pieces: list[list[tuple[int, _Need]]] = []
        self.recv: dict[int, int] = {}
        index = _BoxIndex(d_boxes)
        for k, sbox in enumerate(s_boxes):
            needs: list[_Need] = []
            for j in index.meeting(sbox):
                ov = _intersect(sbox, d_boxes[j])
                if ov is None:
                    continue
                fan_in[j] += 1
                fan_out[k] += 1
                nb = _box_volume(ov) * itemsize
                for r in d_replicas[j]:
                    needs.append(_Need(r, ov, nb))
                    self.recv[r] = self.recv.get(r, 0) + nb
            self.slot_pieces.append(_waterfill(needs, self.nrep))
        self.fan_in = max(fan_in)
        self.fan_out = max(fan_out)
        # bytes per (source shard, slot): the rotation only permutes which rank owns a slot
        self.send_slots: list[list[int]] = []
        for k, assigned in enumerate(self.slot_pieces):
            loads = [0] * len(self.replicas[k])
            for slot, need in assigned:
                loads[slot] += need.nbytes
            self.send_slots.append(loads)
        self.cost = max(max(max(v) for v in self.send_slots), max(self.recv.values()))
        self._rotated: dict[int, tuple[Piece, ...]] = {}
        # rotation -> (pieces by src rank, pieces by dst rank), each in plan order
        self._by_rank: dict[int, tuple[dict[int, tuple[Piece, ...]],
                                       dict[int, tuple[Piece, ...]]]] = {}

    def pieces(self, rotation: int) -> tuple[Piece, ...]:
        cached = self._rotated.get(rotation)
        if cached is not None:
            return cached
        out = []
        for k, assigned in enumerate(self.slot_pieces):
            reps = self.replicas[k]
            nrep = len(reps)
            for slot, need in assigned:
                out.append(Piece(reps[(slot + rotation) % nrep], need.dst_rank, need.box,
                                 need.nbytes))
        out.sort()
        result = tuple(out)
        self._rotated[rotation] = result
        return result

    def by_rank(self, rotation: int) -> tuple[dict[int, tuple[Piece, ...]],
                                              dict[int, tuple[Piece, ...]]]:
        cached = self._by_rank.get(rotation)
        if cached is not None:
            return cached
        src: dict[int, list[Piece]] = {}
        dst: dict[int, list[Piece]] = {}
        for p in self.pieces(rotation):
            src.setdefault(p.src_rank, []).append(p)
            dst.setdefault(p.dst_rank, []).append(p)
        result = ({r: tuple(v) for r, v in src.items()}, {r: tuple(v) for r, v in dst.items()})
        self._by_rank[rotation] = result
        return result


def _m2n_problem(spec: ParamSpec) -> str | None:
    if spec.dtype not in M2N_DTYPES:
        return (f"dtype {spec.dtype} is not supported by transport 'm2n' (supported: "
                f"{', '.join(sorted(M2N_DTYPES))})")
    if not 1 <= len(spec.shape) <= M2N_MAX_TENSOR_RANK:
        return (f"tensor rank {len(spec.shape)} (shape {spec.shape}) is outside 1.."
                f"{M2N_MAX_TENSOR_RANK} supported by transport 'm2n'")
    return None


def _check_mesh(spec_name: str, layout: Layout, side: str, start: int, size: int) -> None:
    m = layout.mesh
    if m.start_rank != start or m.size != size:
        hint = ""
        if side == "source" and m.dims == (1, 1):
            # What specs_from_module gives plain tensors when no process group says how
            # many trainers there are: the most common way to get here.
            hint = (f"; a (1, 1) mesh is specs_from_module's default for plain tensors "
                    f"without a torch.distributed process group: pass mesh=Mesh(({size}, 1)) "
                    f"to specs_from_module, or initialize torch.distributed first")
        raise PlanError(
            f"parameter {spec_name!r} ({side} side): mesh {m.dims} starting at rank "
            f"{m.start_rank} covers ranks [{m.start_rank}, {m.start_rank + m.size}) but the "
            f"{side} ranks are exactly [{start}, {start + size}){hint}")


def validate_source_specs(specs: Sequence[ParamSpec], trainer_ranks: int,
                          transport: str | None = None) -> None:
    """Check the trainer side on its own (the handshake's ``source`` phase).

    Names are unique, every source mesh covers exactly ``[0, trainer_ranks)``, and, given a
    transport, every spec is expressible by it. Raises ``PlanError`` naming the parameter.
    """
    if type(trainer_ranks) is not int or trainer_ranks < 1:
        raise PlanError(f"trainer_ranks must be an int >= 1, got {trainer_ranks!r}")
    if transport is not None:
        check_lane(transport)
    seen: dict[str, int] = {}
    checked: set[Layout] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, ParamSpec):
            raise PlanError(f"source param #{i} must be a ParamSpec, got "
                            f"{type(spec).__name__}")
        prev = seen.setdefault(spec.name, i)
        if prev != i:
            raise PlanError(f"parameter {spec.name!r} appears twice in the plan (positions "
                            f"{prev} and {i})")
        if spec.layout not in checked:
            _check_mesh(spec.name, spec.layout, "source", 0, trainer_ranks)
            checked.add(spec.layout)
        if transport == "m2n":
            problem = _m2n_problem(spec)
            if problem is not None:
                raise PlanError(f"parameter {spec.name!r} (source and destination): "
                                f"{problem}")


class TransferPlan:
    """The ordered parameters to move and everything every rank derives from them.

    Construction validates what holds for any transport (unique names, source meshes cover
    ``[0, trainer_ranks)``, destination meshes cover ``[trainer_ranks, world_size)``, shard
    dims exist and divide evenly); ``validate(transport)`` and ``check_plan_limits`` add the
    transport's rules. Geometry is computed lazily and cached; the caches are filled by
    publishing finished objects, so calls from several threads are safe (at worst a piece of
    geometry is computed twice). A plan is immutable once built.
    """

    def __init__(self, params: Iterable[ParamTransfer], *, trainer_ranks: int,
                 world_size: int) -> None:
        try:
            self.params: tuple[ParamTransfer, ...] = tuple(params)
        except TypeError:  # one ParamTransfer, None, a number: a TypeError from tuple()
            raise PlanError(f"params must be an iterable of ParamTransfer, got "
                            f"{type(params).__name__}") from None
        self.trainer_ranks = trainer_ranks
        self.world_size = world_size
        if type(world_size) is not int or type(trainer_ranks) is not int or not (
                1 <= trainer_ranks < world_size):
            raise PlanError(f"need 1 <= trainer_ranks < world_size, got trainer_ranks="
                            f"{trainer_ranks!r}, world_size={world_size!r}")
        for i, p in enumerate(self.params):
            if not isinstance(p, ParamTransfer):
                raise PlanError(f"plan entry #{i} must be a ParamTransfer, got "
                                f"{type(p).__name__}")
        validate_source_specs([p.spec for p in self.params], trainer_ranks)
        workers = world_size - trainer_ranks
        checked: set[Layout] = set()
        for p in self.params:
            if p.dst not in checked:
                _check_mesh(p.spec.name, p.dst, "destination", trainer_ranks, workers)
                checked.add(p.dst)
        self._index: dict[str, int] | None = None
        self._geo_ids: list[int] | None = None
        self._geo_keys: list[tuple[tuple[int, ...], int, Layout, Layout]] = []
        self._geos: dict[int, _Geometry] = {}
        self._totals: tuple[list[int], list[int]] | None = None
        self._buckets: dict[int, tuple[Bucket, ...]] = {}
        self._costs: list[int] | None = None
        self._digest: str | None = None

    # -- basic access ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        return (f"TransferPlan({len(self.params)} params, trainer_ranks={self.trainer_ranks}, "
                f"world_size={self.world_size})")

    @property
    def worker_ranks(self) -> int:
        """Number of destination (worker) ranks."""
        return self.world_size - self.trainer_ranks

    def index(self, name: str) -> int:
        """Position of parameter ``name``; ``PlanError`` if the plan has none."""
        if self._index is None:
            self._index = {p.spec.name: i for i, p in enumerate(self.params)}
        try:
            return self._index[name]
        except KeyError:
            raise PlanError(f"parameter {name!r} is not in the plan") from None

    def validate(self, transport: str) -> None:
        """Check every parameter is expressible by ``transport`` (``m2n``, ``nccl``, ``gloo``).

        ``m2n``: one of its 12 dtypes and tensor rank 1..3. Any fixed-width dtype and any rank
        otherwise. Fan-in/fan-out limits: ``check_plan_limits``.
        """
        validate_source_specs([p.spec for p in self.params], self.trainer_ranks, transport)

    # -- records and digests -----------------------------------------------------------

    def record(self) -> PlanRecord:
        """The plan as a wire record."""
        return PlanRecord(self.trainer_ranks, self.world_size, self.params)

    @classmethod
    def from_record(cls, record: PlanRecord) -> TransferPlan:
        """Rebuild (and re-validate) a plan from its record."""
        return cls(record.params, trainer_ranks=record.trainer_ranks,
                   world_size=record.world_size)

    def source_specs(self) -> tuple[ParamSpec, ...]:
        """The ordered source specs."""
        return tuple(p.spec for p in self.params)

    # -- geometry ----------------------------------------------------------------------

    def _geo_index(self) -> list[int]:
        if self._geo_ids is None:
            # Built in locals and published at the end: a second thread racing here computes
            # the same lists again instead of seeing half-built ones.
            ids: dict[tuple[tuple[int, ...], str, Layout, Layout], int] = {}
            geo_ids = []
            keys: list[tuple[tuple[int, ...], int, Layout, Layout]] = []
            for p in self.params:
                s = p.spec
                key = (s.shape, s.dtype, s.layout, p.dst)
                gid = ids.get(key)
                if gid is None:
                    gid = ids[key] = len(keys)
                    keys.append((s.shape, DTYPE_ITEMSIZE[s.dtype], s.layout, p.dst))
                geo_ids.append(gid)
            self._geo_keys = keys
            self._geo_ids = geo_ids
        return self._geo_ids

    def _geo(self, gid: int) -> _Geometry:
        g = self._geos.get(gid)
        if g is None:
            g = self._geos[gid] = _Geometry(*self._geo_keys[gid])
        return g

    def _param_geo(self, i: int) -> _Geometry:
        if not 0 <= i < len(self.params):
            raise IndexError(f"param index {i} out of range for a plan of "
                             f"{len(self.params)} params")
        return self._geo(self._geo_index()[i])

    def pieces(self, i: int) -> tuple[Piece, ...]:
        """Every box param ``i`` moves, sorted by ``(src_rank, dst_rank, box)``.

        Each destination rank's box is covered exactly once; a sender packs, and a receiver
        unpacks, its pieces for one peer in this order.
        """
        g = self._param_geo(i)
        return g.pieces(i % g.nrep)

    def pieces_from(self, i: int, rank: int) -> tuple[Piece, ...]:
        """The pieces of param ``i`` that ``rank`` sends, in ``pieces(i)`` order (cached).

        What a sender packs; an O(1) lookup instead of a scan of every piece.
        """
        g = self._param_geo(i)
        return g.by_rank(i % g.nrep)[0].get(rank, ())

    def pieces_to(self, i: int, rank: int) -> tuple[Piece, ...]:
        """The pieces of param ``i`` that ``rank`` receives, in ``pieces(i)`` order (cached)."""
        g = self._param_geo(i)
        return g.by_rank(i % g.nrep)[1].get(rank, ())

    def fan_in(self, i: int) -> int:
        """Most distinct source shards feeding one destination shard of param ``i``."""
        return self._param_geo(i).fan_in

    def fan_out(self, i: int) -> int:
        """Most distinct destination shards reading one source shard of param ``i``."""
        return self._param_geo(i).fan_out

    def param_cost(self, i: int) -> int:
        """Most bytes any one rank sends or receives for param ``i`` (its bucket cost)."""
        return self._param_geo(i).cost

    def param_costs(self) -> list[int]:
        """``param_cost`` of every param, in plan order, cached: bucket splits sum slices of
        it instead of a method call per param. Shared: do not mutate."""
        if self._costs is None:
            self._costs = [self._geo(gid).cost for gid in self._geo_index()]
        return self._costs

    def _compute_totals(self) -> tuple[list[int], list[int]]:
        if self._totals is None:
            send = [0] * self.world_size
            recv = [0] * self.world_size
            # count params per (geometry, rotation) and add each combination once
            counts: dict[tuple[int, int], int] = {}
            for i, gid in enumerate(self._geo_index()):
                g = self._geo(gid)
                key = (gid, i % g.nrep)
                counts[key] = counts.get(key, 0) + 1
            for (gid, rot), n in counts.items():
                g = self._geo(gid)
                for k, loads in enumerate(g.send_slots):
                    reps = g.replicas[k]
                    nrep = len(reps)
                    for slot, b in enumerate(loads):
                        send[reps[(slot + rot) % nrep]] += n * b
                for r, b in g.recv.items():
                    recv[r] += n * b
            self._totals = (send, recv)
        return self._totals

    def send_bytes(self, rank: int) -> int:
        """Bytes ``rank`` sends over the whole plan (0 for a worker)."""
        return self._compute_totals()[0][self._check_rank(rank)]

    def recv_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives over the whole plan (0 for a trainer)."""
        return self._compute_totals()[1][self._check_rank(rank)]

    def total_bytes(self) -> int:
        """Bytes moved over the whole plan (sum over senders)."""
        return sum(self._compute_totals()[0])

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} outside world [0, {self.world_size})")
        return rank

    def lower_bound_seconds(self, bytes_per_second: float) -> float:
        """Transfer time bound: the largest per-rank bytes (either direction) / bandwidth."""
        if not bytes_per_second > 0:
            raise PlanError(f"bytes_per_second must be > 0, got {bytes_per_second!r}")
        send, recv = self._compute_totals()
        return max(max(send), max(recv)) / bytes_per_second

    def buckets(self, bucket_bytes: int) -> tuple[Bucket, ...]:
        """Contiguous runs of params whose summed costs fit ``bucket_bytes`` (see module doc).

        Identical on every rank; a param costlier than ``bucket_bytes`` is a bucket alone.
        """
        if type(bucket_bytes) is not int or bucket_bytes < 1:
            raise PlanError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        cached = self._buckets.get(bucket_bytes)
        if cached is not None:
            return cached
        costs = self.param_costs()
        out: list[Bucket] = []
        start, acc = 0, 0
        for i, c in enumerate(costs):
            if i > start and acc + c > bucket_bytes:
                out.append(Bucket(len(out), start, i, acc))
                start, acc = i, 0
            acc += c
        if costs:
            out.append(Bucket(len(out), start, len(costs), acc))
        result = tuple(out)
        self._buckets[bucket_bytes] = result
        return result


def _sides(p: ParamTransfer) -> str:
    return (f"source placements {show_placements(p.src.placements)} on mesh {p.src.mesh.dims}, "
            f"destination placements {show_placements(p.dst.placements)} on mesh "
            f"{p.dst.mesh.dims}")


def check_plan_limits(plan: TransferPlan, transport: str) -> None:
    """Raise ``PlanError`` if ``transport`` cannot carry a param: fan-in, fan-out, size.

    ``m2n``: at most 16 source shards into one destination shard and 64 destination shards
    out of one source shard (counted as shards, not replicas), and at most
    ``M2N_MAX_CALL_BYTES`` (2 GiB) sent or received by one rank for one param (NCCL's default
    PACK staging; ``auto`` then picks ``nccl``, which has no such limit). ``nccl``/``gloo``:
    no limits.
    """
    check_lane(transport)
    if transport != "m2n":
        return
    gids = plan._geo_index()
    seen: set[int] = set()
    for i, gid in enumerate(gids):
        if gid in seen:
            continue
        seen.add(gid)
        g = plan._geo(gid)
        p = plan.params[i]
        if g.fan_in > M2N_MAX_FAN_IN:
            raise PlanError(
                f"parameter {p.name!r}: fan-in {g.fan_in} source shards into one destination "
                f"shard exceeds the M2N limit {M2N_MAX_FAN_IN} ({_sides(p)})")
        if g.cost > M2N_MAX_CALL_BYTES:
            raise PlanError(
                f"parameter {p.name!r}: one rank sends or receives {g.cost} bytes of it in one "
                f"reshard, over the M2N limit of {M2N_MAX_CALL_BYTES} (2 GiB of NCCL's default "
                f"PACK staging; {_sides(p)}): use transport 'nccl' or shard it finer")
        if g.fan_out > M2N_MAX_FAN_OUT:
            raise PlanError(
                f"parameter {p.name!r}: fan-out {g.fan_out} destination shards from one source "
                f"shard exceeds the M2N limit {M2N_MAX_FAN_OUT} ({_sides(p)})")


def carry_problem(plan: TransferPlan, transport: str) -> str | None:
    """Why ``transport`` cannot carry the whole of ``plan`` (dtypes, tensor rank, M2N's
    fan-in/out and size limits), naming the parameter; None when it can. What ``auto``
    rules lanes out by, and what ``m2n-async plan`` reports per lane."""
    try:
        plan.validate(transport)
        check_plan_limits(plan, transport)
    except PlanError as e:
        return str(e)
    return None


# -- digests --------------------------------------------------------------------------------

_DIGEST_ENCODER: Final = msgspec.msgpack.Encoder()


def _digest(domain: bytes, record: object) -> str:
    # The domain string keeps a source digest from ever equalling a complete-plan digest; the
    # versions make peers on different schemas disagree loudly rather than silently.
    payload = _DIGEST_ENCODER.encode((domain, PROTO_VERSION, PLAN_SCHEMA_VERSION, record))
    return hashlib.sha256(payload).hexdigest()


def source_plan_digest(specs: Sequence[ParamSpec], trainer_ranks: int) -> str:
    """Hex SHA-256 of the ordered source specs (names, dtypes, shapes, layouts)."""
    return _digest(b"m2n_async/source-plan", SourcePlanRecord(trainer_ranks, tuple(specs)))


def complete_plan_digest(plan: TransferPlan) -> str:
    """Hex SHA-256 of the whole plan (source specs, destination layouts, topology)."""
    if plan._digest is None:
        plan._digest = _digest(b"m2n_async/complete-plan", plan.record())
    return plan._digest


# -- local buffers --------------------------------------------------------------------------


class TensorLike(Protocol):
    """What ``validate_local_buffer`` reads from a tensor (torch tensors qualify)."""

    @property
    def dtype(self) -> object: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def device(self) -> object: ...
    def is_contiguous(self) -> bool: ...


#: Dtypes a trainer's source may have when the wire dtype is another of them: the transports
#: convert while packing, in the copy that packs, exactly as ``Tensor.to`` does
#: (round-to-nearest-even). Everything else needs a policy the plan does not carry: int <->
#: float (rounding, range), fp8 (scales), bool, integer widths (overflow).
CAST_DTYPES: Final[frozenset[str]] = frozenset({"float64", "float32", "bfloat16", "float16"})


def cast_problem(source: str, wire: str) -> str | None:
    """Why a source of dtype ``source`` cannot be sent as ``wire`` (canonical names), or None
    when it can: the same dtype, or a plain float cast between two of ``CAST_DTYPES``."""
    if source == wire or (source in CAST_DTYPES and wire in CAST_DTYPES):
        return None
    kinds = {source, wire}
    if any(k.startswith("float8") for k in kinds):
        why = "fp8 needs scales, which the plan does not carry"
    elif "bool" in kinds:
        why = "bool is not a number to cast"
    elif any(k.startswith("complex") for k in kinds):
        why = "complex values do not cast to or from real ones without losing a part"
    elif source in CAST_DTYPES or wire in CAST_DTYPES:
        why = "int <-> float is not a plain cast (rounding and range are a policy)"
    else:
        why = "a different integer width or signedness may overflow"
    return (f"only float-to-float casts ({', '.join(sorted(CAST_DTYPES))}) are done while "
            f"packing, and {why}; convert the tensor yourself or declare the ParamSpec with "
            f"dtype {source}")


def check_source_dtype(spec: ParamSpec, dtype: object, rank: int) -> None:
    """Raise ``PlanError`` naming the parameter, the rank and both dtypes unless a source of
    ``dtype`` (a ``torch.dtype`` or a name) can be sent as ``spec``'s wire dtype
    (``cast_problem``)."""
    try:
        got = dtype_name(dtype)
    except PlanError:  # e.g. a quantized dtype: report it as it spells itself
        got = str(dtype).removeprefix("torch.")
    problem = cast_problem(got, spec.dtype)
    if problem is not None:
        raise PlanError(f"parameter {spec.name!r} (source side, rank {rank}): tensor dtype "
                        f"{got} cannot be sent as the planned (wire) dtype {spec.dtype}: "
                        f"{problem}")


def _tp_axis_hint(layout: Layout, side: str) -> str:
    # Placements that shard along a TP axis of size 1 shard nothing: most likely the worker
    # left mesh_dims at its default (N, 1) while its targets are TP shards.
    dims, p = layout.mesh.dims, layout.placements
    if side != "destination" or p is None or p[1] == REPLICATE or dims[1] != 1 or dims[0] == 1:
        return ""
    return (f"; the TP axis (1) has size 1, so placements {show_placements(p)} shard nothing "
            f"along it: did you mean mesh_dims=(1, {dims[0]})?")


def validate_local_buffer(spec_or_transfer: ParamSpec | ParamTransfer, tensor_like: TensorLike,
                          rank: int, side: str, *, device: str | None = None,
                          cast: bool = False) -> None:
    """Check a tensor a rank hands in for one param: dtype, local shape, contiguity, device.

    ``side`` is ``"source"`` (checked against the spec's layout) or ``"destination"`` (needs
    a ``ParamTransfer``; checked against its ``dst`` layout). ``device``, if given, is the
    expected device (``"cuda:1"``; ``"cuda"`` accepts any index). ``cast`` (source side only):
    accept a dtype the transports cast to the planned (wire) dtype while packing
    (``cast_problem``); without it, and always on the destination side, the dtype must be the
    planned one — a worker's target is written as wire bytes. Duck-typed: no torch here.
    """
    if side not in ("source", "destination"):
        raise PlanError(f"side must be 'source' or 'destination', got {side!r}")
    if cast and side != "source":
        raise PlanError("validate_local_buffer: cast=True applies to the source side only "
                        "(a destination is written as wire bytes)")
    if isinstance(spec_or_transfer, ParamTransfer):
        spec = spec_or_transfer.spec
        layout = spec_or_transfer.dst if side == "destination" else spec.layout
    else:
        spec = spec_or_transfer
        if side == "destination":
            raise PlanError(f"parameter {spec.name!r}: the destination side needs the "
                            f"ParamTransfer (its destination layout), got a ParamSpec")
        layout = spec.layout
    where = f"parameter {spec.name!r} ({side} side, rank {rank})"
    if not layout.mesh.contains(rank):
        m = layout.mesh
        raise PlanError(f"{where}: rank is not in the {side} mesh [{m.start_rank}, "
                        f"{m.start_rank + m.size})")
    try:
        got_dtype = dtype_name(tensor_like.dtype)
    except PlanError:  # e.g. a quantized dtype: report it as it spells itself
        got_dtype = str(tensor_like.dtype).removeprefix("torch.")
    if got_dtype != spec.dtype:
        if not cast:
            raise PlanError(f"{where}: tensor dtype {got_dtype} != planned dtype {spec.dtype}")
        check_source_dtype(spec, got_dtype, rank)
    if getattr(tensor_like, "is_nested", False):  # its shape raises: refused by name here
        raise PlanError(f"{where}: a nested tensor; a local shard is a dense tensor of the "
                        f"local shard shape")
    want = layout.local_shape(spec.shape, rank)
    got_shape = tuple(int(n) for n in tensor_like.shape)
    if got_shape != want:
        raise PlanError(f"{where}: tensor shape {got_shape} != local shard shape {want} "
                        f"(global shape {spec.shape}, placements "
                        f"{show_placements(layout.placements)}, mesh {layout.mesh.dims})"
                        f"{_tp_axis_hint(layout, side)}")
    if not tensor_like.is_contiguous():
        raise PlanError(f"{where}: tensor is not contiguous (call .contiguous() first)")
    if device is not None:
        got_dev = str(tensor_like.device)
        ok = got_dev == device or (":" not in device and got_dev.split(":")[0] == device)
        if not ok:
            raise PlanError(f"{where}: tensor is on device {got_dev}, expected {device}")
