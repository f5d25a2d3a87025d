"""specs_from_module / module_shards: DTensor, FSDP2, TP and plain modules → ParamSpecs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from m2n_async import PlanError
from m2n_async._integrations.sources import module_shards, specs_from_module
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import TransferPlan, validate_local_buffer, validate_source_specs


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8, bias=False)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


def _module(name: str, tensor: DTensor) -> nn.Module:
    m = nn.Module()
    m.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    return m


# -- plain modules (no process group) ----------------------------------------------------


def test_plain_module_is_replicated_on_a_one_rank_mesh() -> None:
    specs = specs_from_module(Tiny())
    assert [s.name for s in specs] == ["embed.weight", "up.weight", "up.bias", "down.weight"]
    assert specs[1] == ParamSpec("up.weight", torch.float32, (32, 8), Layout(Mesh((1, 1)), None))


def test_dtype_casts_floats_only_and_buffers_are_persistent_only() -> None:
    specs = specs_from_module(Tiny(), dtype=torch.bfloat16, buffers=True)
    by_name = {s.name: s.dtype for s in specs}
    assert by_name == {"embed.weight": "bfloat16", "up.weight": "bfloat16",
                       "up.bias": "bfloat16", "down.weight": "bfloat16", "steps": "int64"}


def test_the_one_rank_default_on_several_trainers_says_what_to_pass() -> None:
    # Two trainers, no process group: the source phase refuses the (1, 1) default and says
    # how to fix it, not only that the ranks differ.
    specs = specs_from_module(Tiny())
    with pytest.raises(PlanError, match=r"parameter 'embed.weight' \(source side\): mesh "
                                        r"\(1, 1\) .* are exactly \[0, 2\); .*pass "
                                        r"mesh=Mesh\(\(2, 1\)\) to specs_from_module, or "
                                        r"initialize torch.distributed first"):
        validate_source_specs(specs, 2)


def test_explicit_mesh_for_plain_tensors() -> None:
    specs = specs_from_module(Tiny(), mesh=Mesh((4, 1)))
    assert {s.layout for s in specs} == {Layout(Mesh((4, 1)), None)}


def test_rename_maps_and_filters_and_refuses_collisions() -> None:
    specs = specs_from_module(Tiny(), rename=lambda n: None if n.startswith("embed")
                              else "model." + n)
    assert [s.name for s in specs] == ["model.up.weight", "model.up.bias", "model.down.weight"]
    with pytest.raises(PlanError, match=r"'embed.weight' and 'up.weight' both map to plan name"):
        specs_from_module(Tiny(), rename=lambda n: "x")


def test_wrapper_segments_are_dropped_and_tied_weights_appear_once() -> None:
    inner = Tiny()
    inner.down.weight = inner.up.weight  # tie (shapes differ in meaning, not for the test)
    outer = nn.Module()
    outer._orig_mod = inner  # what torch.compile inserts
    names = [s.name for s in specs_from_module(outer)]
    assert names == ["embed.weight", "up.weight", "up.bias"]


def test_module_shards_is_lazy_uncached_and_casts() -> None:
    model = Tiny()
    shards = module_shards(model, ["up.bias", "up.weight"], dtype="bfloat16")
    assert list(shards) == ["up.bias", "up.weight"] and len(shards) == 2
    first = shards["up.bias"]
    assert first.dtype == torch.bfloat16 and not first.requires_grad
    with torch.no_grad():
        model.up.bias.fill_(3.0)  # an optimizer step after the mapping was built
    assert torch.equal(shards["up.bias"], torch.full((32,), 3.0, dtype=torch.bfloat16))
    assert torch.all(first != 3.0)  # the earlier lookup was a copy, not a cached view
    # without a cast the shard is the parameter's own storage (no copy)
    assert module_shards(model)["up.weight"].data_ptr() == model.up.weight.data_ptr()


def test_module_shards_names_missing_parameters() -> None:
    with pytest.raises(PlanError, match=r"2 plan parameter\(s\) not found.*'a.weight', 'b'"):
        module_shards(Tiny(), ["up.weight", "a.weight", "b"])
    with pytest.raises(KeyError, match="nope"):
        module_shards(Tiny())["nope"]


# -- DTensor / FSDP2 / TP under a pretend world ---------------------------------------------


def test_fsdp2_on_a_1d_mesh(fake_world) -> None:
    with fake_world(5, 8):
        mesh = init_device_mesh("cpu", (8,))
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        specs = specs_from_module(model, dtype=torch.bfloat16)
        layout = Layout(Mesh((8, 1), 0), (0, REPLICATE))
        assert [(s.name, s.shape, s.layout) for s in specs] == [
            ("0.weight", (32, 16), layout), ("0.bias", (32,), layout),
            ("2.weight", (16, 32), layout), ("2.bias", (16,), layout)]
        # every local shard fits the spec on this rank (dtype, local shape, contiguity)
        shards = module_shards(model, [s.name for s in specs], dtype=torch.bfloat16)
        for s in specs:
            validate_local_buffer(s, shards[s.name], 5, "source")
        # and the specs make a valid plan towards a 4-rank TP worker mesh
        dst = Layout(Mesh((1, 4), 8), (REPLICATE, 0))
        plan = TransferPlan([ParamTransfer(s, dst) for s in specs], trainer_ranks=8,
                            world_size=12)
        assert plan.recv_bytes(8) == sum(s.nbytes for s in specs) // 4


def test_tp_on_a_2d_mesh_maps_placements(fake_world) -> None:
    with fake_world(6, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        full = torch.arange(32.0 * 8).reshape(32, 8)
        cases = {
            (Replicate(), Shard(1)): Layout(Mesh((2, 4)), (REPLICATE, 1)),
            (Shard(0), Replicate()): Layout(Mesh((2, 4)), (0, REPLICATE)),
            (Replicate(), Replicate()): Layout(Mesh((2, 4)), None),
            # Shard(0) on both axes nests row-major == one axis of all 8 ranks
            (Shard(0), Shard(0)): Layout(Mesh((8, 1)), (0, REPLICATE)),
            (Shard(-1), Replicate()): Layout(Mesh((2, 4)), (1, REPLICATE)),
        }
        for placements, want in cases.items():
            d = distribute_tensor(full, mesh, list(placements))
            (spec,) = specs_from_module(_module("w", d))
            assert spec.layout == want, placements
            assert spec.shape == (32, 8)
            local = module_shards(_module("w", d))["w"]
            validate_local_buffer(spec, local, 6, "source")


def test_shard_on_a_size_one_axis_is_a_replica(fake_world) -> None:
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (1, 4))
        d = distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0), Shard(1)])
        (spec,) = specs_from_module(_module("w", d))
        assert spec.layout == Layout(Mesh((1, 4)), (REPLICATE, 1))


def test_tp_submesh_is_contiguous(fake_world) -> None:
    with fake_world(5, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        specs = {s.name: s.layout for s in specs_from_module(model)}
        tp = Mesh((4, 1), 4)  # rank 5's TP group is ranks [4, 8)
        assert specs == {"0.weight": Layout(tp, (0, REPLICATE)),
                         "0.bias": Layout(tp, (0, REPLICATE)),
                         "2.weight": Layout(tp, (1, REPLICATE)),
                         "2.bias": Layout(tp, None)}


@pytest.mark.parametrize(("what", "pattern"), [
    ("partial", r"parameter 'w': placement Partial\(sum\) on mesh axis 0.*Reduce first"),
    ("two_dims", r"parameter 'w': mesh axes 0 and 1 shard different tensor dims.*redistribute"),
    ("uneven", r"parameter 'w': dim 0 of size 9 is split 2 ways unevenly.*pad the dim"),
    ("mesh3d", r"parameter 'w': its device mesh has 3 dims \(2, 2, 2\).*Flatten"),
    ("strided_submesh", r"parameter 'w': its device mesh ranks \[1, 5\] are not a contiguous"),
    ("fsdp_over_tp", r"parameter '0.weight': placement _StridedShard.* is not a plain Shard"),
])
def test_unsupported_layouts_are_refused_by_name(fake_world, what: str, pattern: str) -> None:
    with fake_world(1, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        if what == "fsdp_over_tp":
            module = nn.Sequential(nn.Linear(16, 32))
            parallelize_module(module, mesh["tp"], {"0": ColwiseParallel()})
            fully_shard(module, mesh=mesh["dp"])
        else:
            if what == "partial":
                d = DTensor.from_local(torch.zeros(4, 4), mesh, [Partial(), Replicate()],
                                       run_check=False)
            elif what == "two_dims":
                d = distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0), Shard(1)])
            elif what == "uneven":
                d = distribute_tensor(torch.zeros(9, 4), mesh, [Shard(0), Replicate()])
            elif what == "mesh3d":
                m3 = init_device_mesh("cpu", (2, 2, 2))
                d = distribute_tensor(torch.zeros(4, 4), m3, [Shard(0), Replicate(),
                                                              Replicate()])
            else:
                d = distribute_tensor(torch.zeros(4, 4), mesh["dp"], [Shard(0)])
            module = _module("w", d)
        with pytest.raises(PlanError, match=pattern):
            specs_from_module(module)


def _mesh_cases() -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    cases = []
    for dims in [(8,), (2, 4), (4, 2), (1, 8)]:
        names = ["R", "S0", "S1"]
        combos = [(a,) for a in [*names, "S-1"]] if len(dims) == 1 else [
            (a, b) for a in names for b in names]
        for combo in combos:
            if "S0" in combo and ("S1" in combo or "S-1" in combo):
                continue  # two axes sharding different dims: refused (tested above)
            cases.append((dims, combo))
    return cases


@pytest.mark.parametrize(("dims", "combo"), _mesh_cases())
def test_layouts_agree_with_torch_on_every_rank(fake_world, dims: tuple[int, ...],
                                                combo: tuple[str, ...]) -> None:
    """Ground truth: DTensor's own local shape and global offset on each rank equal the box
    our Layout gives that rank (this is what makes the Shard(d)-on-both-axes re-factoring
    and the size-1-axis rule safe)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def placement(name: str) -> Shard | Replicate:
        return Replicate() if name == "R" else Shard(int(name[1:]))

    shape = (16, 8)
    for rank in range(8):
        with fake_world(rank, 8):
            mesh = init_device_mesh("cpu", dims)
            pls = [placement(n) for n in combo]
            # metadata only: a 1x1 local tensor (same rank as the global, so Shard(-1) means
            # the last dim) standing for a (16, 8) global one
            d = DTensor.from_local(torch.zeros(1, 1), mesh, pls, run_check=False,
                                   shape=torch.Size(shape),
                                   stride=torch.empty(shape).stride())
            (spec,) = specs_from_module(_module("w", d))
            local, offset = compute_local_shape_and_global_offset(shape, mesh, d.placements)
            want = tuple((o, o + n) for o, n in zip(offset, local, strict=True))
            assert spec.layout.box(shape, rank) == want, (rank, spec.layout)


def test_non_contiguous_parameters_are_handed_over_contiguous() -> None:
    # channels_last conv weights: the module passes specs_from_module, so sync_weights(model)
    # must be able to send them (the engine packs contiguous shards).
    from m2n_async._integrations.sources import module_shards
    from m2n_async._proto.plan import validate_local_buffer

    model = nn.Sequential(nn.Conv2d(3, 8, 3)).to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    specs = specs_from_module(model)
    shards = module_shards(model, [s.name for s in specs])
    for s in specs:
        validate_local_buffer(s, shards[s.name], 0, "source")
    assert torch.equal(shards["0.weight"], model[0].weight.detach())


def test_a_shape_of_2_to_the_63_elements_is_refused() -> None:
    with pytest.raises(PlanError, match=r"2\*\*63 or more elements"):
        ParamSpec("huge", torch.bfloat16, (2**32, 2**31), Layout(Mesh((1, 1)), None))


@pytest.mark.parametrize("orig_params", [False, True])
def test_fsdp1_is_refused_outside_summon_full_params(fake_world, orig_params: bool) -> None:
    # With use_orig_params=True the visible parameters are 1-D fragments of the flat shard
    # (rank 1 read '0.weight' as (6,) replicated, the truth being (6, 8)): refused, saying
    # what to use instead, like the FlatParameter of use_orig_params=False.
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with fake_world(1, 2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4)),
                     use_orig_params=orig_params, device_id=torch.device("cpu"))
        with pytest.raises(PlanError, match=r"FSDP.*summon_full_params|FlatParameter"):
            specs_from_module(model)
