"""Mesh and Layout: validation and geometry against hand-computed cases."""

from __future__ import annotations

import msgspec
import pytest

from m2n_async import REPLICATE, Layout, Mesh, PlanError


def test_mesh_basics() -> None:
    m = Mesh((2, 3), start_rank=4)
    assert m.size == 6
    assert m.ranks == range(4, 10)
    assert m.contains(4) and m.contains(9)
    assert not m.contains(3) and not m.contains(10)
    # row-major: rank = start + i * dims[1] + j
    assert [m.coords(r) for r in m.ranks] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert m.rank_at(1, 2) == 9


def test_mesh_normalizes_lists_and_hashes() -> None:
    m = Mesh([2, 2])  # type: ignore[arg-type]
    assert m.dims == (2, 2)
    assert hash(m) == hash(Mesh((2, 2)))


@pytest.mark.parametrize(
    ("dims", "start", "match"),
    [
        ((4,), 0, r"two positive ints.*\(4,\)"),
        ((2, 2, 2), 0, r"two positive ints"),
        ((0, 2), 0, r"two positive ints.*\(0, 2\)"),
        ((2, -1), 0, r"two positive ints"),
        ((True, 2), 0, r"two positive ints"),
        ((2, 2), -1, r"start_rank must be an int >= 0, got -1"),
    ],
)
def test_mesh_rejects(dims: tuple[int, ...], start: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Mesh(dims, start)  # type: ignore[arg-type]


def test_coords_outside_mesh_names_rank_and_interval() -> None:
    with pytest.raises(PlanError, match=r"rank 7 is not in mesh \(2, 2\) .*\[2, 6\)"):
        Mesh((2, 2), 2).coords(7)


@pytest.mark.parametrize(
    ("placements", "match"),
    [
        ((REPLICATE, REPLICATE), r"spelled None"),
        ((0, 1), r"exactly one mesh axis may shard"),
        ((0,), r"2-tuple"),
        ((0, -2), r"2-tuple"),
        ((REPLICATE, 0, 0), r"2-tuple"),
    ],
)
def test_layout_rejects_placements(placements: tuple[int, ...], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Layout(Mesh((2, 2)), placements)  # type: ignore[arg-type]


def test_layout_shard_on_axis0() -> None:
    # axis 0 (size 2) shards dim 1; axis 1 (size 3) replicates
    lay = Layout(Mesh((2, 3), 10), (1, REPLICATE))
    shape = (5, 8)
    assert lay.shard_axis == 0 and lay.shard_dim == 1
    assert lay.num_shards == 2 and lay.num_replicas == 3
    assert [lay.shard_index(r) for r in range(10, 16)] == [0, 0, 0, 1, 1, 1]
    assert lay.replicas(1) == (13, 14, 15)
    assert lay.box(shape, 11) == ((0, 5), (0, 4))
    assert lay.box(shape, 15) == ((0, 5), (4, 8))
    assert lay.local_shape(shape, 12) == (5, 4)


def test_layout_shard_on_axis1() -> None:
    lay = Layout(Mesh((2, 3), 0), (REPLICATE, 0))
    shape = (6, 2, 3)
    assert lay.num_shards == 3 and lay.num_replicas == 2
    assert [lay.shard_index(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert lay.replicas(2) == (2, 5)
    assert lay.box(shape, 4) == ((2, 4), (0, 2), (0, 3))
    assert lay.local_shape(shape, 4) == (2, 2, 3)


def test_layout_replicated_and_resolved() -> None:
    lay = Layout(Mesh((2, 2), 3), None)
    assert lay.num_shards == 1 and lay.num_replicas == 4
    assert lay.replicas(0) == (3, 4, 5, 6)
    assert lay.box((3, 4), 6) == ((0, 3), (0, 4))
    assert lay.resolved() == Layout(Mesh((4, 1), 3), None)
    sharded = Layout(Mesh((2, 2), 3), (0, REPLICATE))
    assert sharded.resolved() is sharded


def test_shape_problems_name_numbers() -> None:
    lay = Layout(Mesh((4, 1)), (0, REPLICATE))
    assert lay.shape_problem((8, 3)) is None
    assert "does not divide evenly into 4 shards" in str(lay.shape_problem((6, 3)))
    assert "dim 0 of size 6" in str(lay.shape_problem((6, 3)))
    lay2 = Layout(Mesh((1, 2)), (REPLICATE, 2))
    assert "shard dim 2 does not exist in a tensor of rank 2" in str(lay2.shape_problem((4, 4)))
    with pytest.raises(PlanError, match="does not exist"):
        lay2.box((4, 4), 0)
    with pytest.raises(PlanError, match="out of range"):
        lay2.replicas(2)
    with pytest.raises(PlanError, match="rank 5 is not in mesh"):
        lay2.local_shape((4, 4, 4), 5)


def test_layout_decodes_and_validates() -> None:
    raw = msgspec.msgpack.encode({"mesh": {"dims": [2, 2], "start_rank": 0},
                                  "placements": [0, 0]})
    with pytest.raises(msgspec.ValidationError, match="exactly one mesh axis"):
        msgspec.msgpack.decode(raw, type=Layout)
    ok = msgspec.msgpack.encode(Layout(Mesh((2, 2)), (REPLICATE, 1)))
    assert msgspec.msgpack.decode(ok, type=Layout) == Layout(Mesh((2, 2)), (REPLICATE, 1))


class _IndexInt:
    """An int in disguise, as numpy's and torch's are: it has ``__index__`` only."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_index_ints_are_stored_as_plain_ints() -> None:
    m = Mesh((_IndexInt(2), _IndexInt(4)), _IndexInt(8))  # type: ignore[arg-type]
    assert m == Mesh((2, 4), 8) and hash(m) == hash(Mesh((2, 4), 8))
    assert all(type(n) is int for n in (*m.dims, m.start_rank))
    lay = Layout(m, (_IndexInt(1), REPLICATE))  # type: ignore[arg-type]
    assert lay == Layout(Mesh((2, 4), 8), (1, REPLICATE))
    assert msgspec.msgpack.encode(lay) == msgspec.msgpack.encode(Layout(Mesh((2, 4), 8),
                                                                        (1, REPLICATE)))
    # bool stays refused: True is no size and no dim
    with pytest.raises(PlanError, match="two positive ints"):
        Mesh((2, True))
    with pytest.raises(PlanError, match="2-tuple"):
        Layout(Mesh((2, 2)), (True, REPLICATE))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Mesh(8), r"two positive ints .*got 8"),  # type: ignore[arg-type]
        (lambda: Mesh(None), r"two positive ints .*got None"),  # type: ignore[arg-type]
        (lambda: Layout(Mesh((2, 2)), 0), r"2-tuple .*got 0"),  # type: ignore[arg-type]
        (lambda: Layout((2, 2)), r"Layout mesh must be a Mesh, got tuple"),  # type: ignore[arg-type]
        (lambda: Layout(None, (0, REPLICATE)), r"must be a Mesh, got NoneType"),  # type: ignore[arg-type]
    ],
)
def test_non_sequences_and_non_meshes_are_plan_errors(make: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make()  # type: ignore[operator]


def test_coordinates_and_shards_outside_the_mesh_are_refused() -> None:
    m = Mesh((2, 4), 8)
    assert m.rank_at(1, 3) == 15
    # (0, 4) would otherwise be rank (1, 0)'s number, (2, 0) a rank past the mesh
    for i, j in ((0, 4), (2, 0), (-1, 0), (0, -1)):
        with pytest.raises(PlanError, match=rf"mesh coordinate \({i}, {j}\) is outside mesh"):
            m.rank_at(i, j)
    lay = Layout(m, (0, REPLICATE))
    assert lay.shard_box((4, 2), 1) == ((2, 4), (0, 2))
    for shard in (2, -1):  # a box past either end of the tensor otherwise
        with pytest.raises(PlanError, match=rf"shard {shard} out of range for 2 shards"):
            lay.shard_box((4, 2), shard)
    with pytest.raises(PlanError, match="shard 1 out of range for 1 shards"):
        Layout(m).shard_box((4, 2), 1)
