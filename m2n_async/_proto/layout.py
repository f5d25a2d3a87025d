"""Meshes, placements and the box each rank holds.

Theory of operation: a ``Mesh`` is a contiguous, row-major rank interval factored into exactly
two axes (a 1-D topology is ``(n, 1)``): the rank at mesh coordinate ``(i, j)`` is
``start_rank + i * dims[1] + j``, the same convention NCCL M2N uses. A ``Layout`` puts a tensor
on a mesh with one placement per mesh axis: ``REPLICATE`` (-1) or the tensor dim that axis
shards. Exactly one axis shards (the other replicates), or ``placements`` is ``None`` for a fully
replicated tensor; ``(REPLICATE, REPLICATE)`` is refused so that it has one spelling (and so
one digest). A shard along a mesh axis of size 1 (one piece: the whole tensor) holds what a
replica holds but is kept as written, so that its dim is still checked against the shape;
plan files and ``specs_from_module`` write it as ``None``, and so should callers that want
its digest and stacks to be a replica's. A layout therefore splits the tensor into
``num_shards`` equal slabs along one dim; shard ``k`` is held by every rank whose coordinate on
the sharded axis is ``k`` (its replicas).

Everything here is pure arithmetic on ints and tuples; geometry that depends on a tensor shape
takes the shape as an argument, so one ``Layout`` serves every parameter that shares it.
"""

from __future__ import annotations

import operator
from typing import Final

import msgspec

from m2n_async._proto.errors import PlanError

__all__ = ["REPLICATE", "Box", "Layout", "Mesh", "show_placements"]

REPLICATE: Final[int] = -1
"""Placement of a mesh axis along which the tensor is replicated (``Replicate()`` in M2N)."""

def show_placements(placements: tuple[int, ...] | None) -> str:
    """Placements as people read them in messages: ``(REPLICATE, 1)``, ``replicated``."""
    if placements is None:
        return "replicated"
    return "(" + ", ".join("REPLICATE" if p == REPLICATE else str(p) for p in placements) + ")"


Box = tuple[tuple[int, int], ...]
"""Per tensor dim ``(start, stop)`` in global coordinates, half open."""


def _index_int(value: object) -> int | None:
    """``value`` as an exact int when it is one in disguise (numpy or torch ints, anything
    with ``__index__``), else None; bool is an int subclass but no size, rank or dim."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _dims_error(dims: object) -> PlanError:
    return PlanError(f"Mesh dims must be two positive ints (use (n, 1) for a 1-D mesh), got "
                     f"{dims!r}")


class Mesh(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A contiguous rank interval ``[start_rank, start_rank + dims[0] * dims[1])``, row-major.

    ``dims`` has exactly two positive entries; use ``(n, 1)`` for a 1-D topology.
    """

    dims: tuple[int, int]
    start_rank: int = 0

    def __post_init__(self) -> None:
        # Normalize lists (e.g. from user code) to tuples so equality and hashing behave.
        # Runs for every mesh decoded off the wire too (10^5 per plan): keep it branch-cheap.
        dims: tuple[int, ...] = self.dims
        if type(dims) is not tuple:  # a list from user code
            try:
                dims = tuple(dims)
            except TypeError:  # Mesh(8): not a pair at all
                raise _dims_error(self.dims) from None
            msgspec.structs.force_setattr(self, "dims", dims)
        if len(dims) != 2:
            raise _dims_error(self.dims)
        d0, d1 = dims
        # type() not isinstance(): bool is an int subclass and True is no size.
        if type(d0) is not int or type(d1) is not int:
            # numpy/torch ints (``world // tp`` computed with numpy): stored as plain ints,
            # so equality, hashing and the digest match a mesh written with literals.
            i0, i1 = _index_int(d0), _index_int(d1)
            if i0 is None or i1 is None:
                raise _dims_error(self.dims)
            d0, d1 = i0, i1
            msgspec.structs.force_setattr(self, "dims", (d0, d1))
        if d0 < 1 or d1 < 1:
            raise _dims_error(self.dims)
        start = self.start_rank
        if type(start) is not int:
            start_int = _index_int(start)
            if start_int is None:
                raise PlanError(f"Mesh start_rank must be an int >= 0, got {start!r}")
            msgspec.structs.force_setattr(self, "start_rank", start_int)
            start = start_int
        if start < 0:
            raise PlanError(f"Mesh start_rank must be an int >= 0, got {self.start_rank!r}")

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return self.dims[0] * self.dims[1]

    @property
    def ranks(self) -> range:
        """The rank interval the mesh owns, in row-major coordinate order."""
        return range(self.start_rank, self.start_rank + self.size)

    def contains(self, rank: int) -> bool:
        """Whether ``rank`` lies in this mesh."""
        return self.start_rank <= rank < self.start_rank + self.size

    def coords(self, rank: int) -> tuple[int, int]:
        """Mesh coordinate ``(i, j)`` of ``rank``; raises ``PlanError`` outside the mesh."""
        if not self.contains(rank):
            raise PlanError(f"rank {rank} is not in mesh {self.dims} starting at rank "
                            f"{self.start_rank} (ranks [{self.start_rank}, "
                            f"{self.start_rank + self.size}))")
        return divmod(rank - self.start_rank, self.dims[1])

    def rank_at(self, i: int, j: int) -> int:
        """Rank at mesh coordinate ``(i, j)``."""
        d0, d1 = self.dims
        # Unchecked, (0, d1) would name rank (1, 0): another rank of the mesh, or one outside.
        if not (0 <= i < d0 and 0 <= j < d1):
            raise PlanError(f"mesh coordinate ({i}, {j}) is outside mesh {self.dims} "
                            f"(coordinates [0, {d0}) x [0, {d1}))")
        return self.start_rank + i * d1 + j


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """How a tensor is placed on a mesh.

    ``placements`` gives, per mesh axis, ``REPLICATE`` or the tensor dim the axis shards;
    exactly one axis shards. ``None`` means fully replicated. Whether the sharded dim exists
    and divides evenly depends on the tensor shape; ``ParamSpec``/``TransferPlan`` check that.
    """

    mesh: Mesh
    placements: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        # Caught here, not later as an AttributeError deep in the geometry.
        if not isinstance(self.mesh, Mesh):
            raise PlanError(f"Layout mesh must be a Mesh, got {type(self.mesh).__name__} "
                            f"{self.mesh!r} (e.g. Layout(Mesh((n, 1)), (0, REPLICATE)))")
        p: tuple[int, ...] | None = self.placements
        if p is None:
            return
        if type(p) is not tuple:  # a list from user code
            try:
                p = tuple(p)
            except TypeError:  # Layout(mesh, 0): one dim, not one placement per axis
                p = ()
            else:
                msgspec.structs.force_setattr(self, "placements", p)
        if len(p) == 2 and (type(p[0]) is not int or type(p[1]) is not int):
            # numpy/torch ints, stored as plain ints (one spelling, one digest)
            q0, q1 = _index_int(p[0]), _index_int(p[1])
            if q0 is not None and q1 is not None:
                p = (q0, q1)
                msgspec.structs.force_setattr(self, "placements", p)
        if (len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int
                or p[0] < REPLICATE or p[1] < REPLICATE):
            raise PlanError(f"placements must be a 2-tuple of REPLICATE (-1) or a tensor dim "
                            f">= 0 per mesh axis, or None for a fully replicated tensor; "
                            f"got {self.placements!r}")
        sharded = (p[0] != REPLICATE) + (p[1] != REPLICATE)
        if sharded == 0:
            raise PlanError("placements (REPLICATE, REPLICATE) are spelled None (fully "
                            "replicated); got (-1, -1)")
        if sharded == 2:
            raise PlanError(f"exactly one mesh axis may shard a tensor (the other must be "
                            f"REPLICATE); got placements {p!r}")

    # -- derived facts (cheap; callers on hot paths cache per layout) --------------------

    @property
    def shard_axis(self) -> int | None:
        """The mesh axis that shards the tensor, or ``None`` when fully replicated."""
        p = self.placements
        if p is None:
            return None
        return 0 if p[0] != REPLICATE else 1

    @property
    def shard_dim(self) -> int | None:
        """The tensor dim that is sharded, or ``None`` when fully replicated."""
        p = self.placements
        if p is None:
            return None
        return p[0] if p[0] != REPLICATE else p[1]

    @property
    def num_shards(self) -> int:
        """Number of distinct shards (1 when fully replicated)."""
        axis = self.shard_axis
        return 1 if axis is None else self.mesh.dims[axis]

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each shard."""
        return self.mesh.size // self.num_shards

    def shard_index(self, rank: int) -> int:
        """Which shard ``rank`` holds (replicas of one shard share the index)."""
        i, j = self.mesh.coords(rank)
        axis = self.shard_axis
        if axis is None:
            return 0
        return i if axis == 0 else j

    def replicas(self, shard: int) -> tuple[int, ...]:
        """The ranks holding shard ``shard``, ascending."""
        m = self.mesh
        axis = self.shard_axis
        if axis is None:
            return tuple(m.ranks)
        if not 0 <= shard < m.dims[axis]:
            raise PlanError(f"shard {shard} out of range for {m.dims[axis]} shards")
        if axis == 0:
            return tuple(m.rank_at(shard, j) for j in range(m.dims[1]))
        return tuple(m.rank_at(i, shard) for i in range(m.dims[0]))

    def shard_box(self, shape: tuple[int, ...], shard: int) -> Box:
        """The global box of shard ``shard`` of a tensor of ``shape``."""
        # Unchecked, shard 2 of 2 would be a box past the end of the tensor.
        if not 0 <= shard < self.num_shards:
            raise PlanError(f"shard {shard} out of range for {self.num_shards} shards")
        d = self.shard_dim
        if d is None:
            return tuple((0, n) for n in shape)
        self._check_shape(shape)
        step = shape[d] // self.num_shards
        return tuple((shard * step, (shard + 1) * step) if k == d else (0, n)
                     for k, n in enumerate(shape))

    def box(self, shape: tuple[int, ...], rank: int) -> Box:
        """The global box ``rank`` holds of a tensor of ``shape``."""
        return self.shard_box(shape, self.shard_index(rank))

    def local_shape(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """Shape of the local shard ``rank`` holds (checks ``rank`` is in the mesh)."""
        self.mesh.coords(rank)
        return self.shard_shape(shape)

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of every shard of a tensor of ``shape`` (all shards are equal)."""
        d = self.shard_dim
        if d is None:
            return tuple(shape)
        self._check_shape(shape)
        n = self.num_shards
        return tuple(s // n if k == d else s for k, s in enumerate(shape))

    def resolved(self) -> Layout:
        """The layout as M2N sees it: fully replicated -> mesh re-factored ``(size, 1)``."""
        if self.placements is not None or self.mesh.dims[1] == 1:
            return self
        return Layout(Mesh((self.mesh.size, 1), self.mesh.start_rank), None)

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why ``shape`` cannot be placed by this layout, or ``None`` if it can."""
        p = self.placements
        if p is None:
            return None
        # inlined shard_dim/num_shards: this runs once per spec, also when decoding
        if p[0] != REPLICATE:
            d, n = p[0], self.mesh.dims[0]
        else:
            d, n = p[1], self.mesh.dims[1]
        if d >= len(shape):
            return (f"shard dim {d} does not exist in a tensor of rank {len(shape)} "
                    f"(shape {tuple(shape)}, placements {show_placements(self.placements)})")
        if shape[d] % n:
            return (f"dim {d} of size {shape[d]} does not divide evenly into {n} shards "
                    f"(placements {show_placements(self.placements)}, mesh {self.mesh.dims})")
        return None

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        problem = self.shape_problem(shape)
        if problem is not None:
            raise PlanError(problem)
